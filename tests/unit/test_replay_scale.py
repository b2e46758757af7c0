"""Scale events in the routing replay (lab/bench/replay_elastic.py): the replicas
change as the trace reaches each event, L3 serves what a departed replica held only
in the elastic arms, and the windows count exactly the requests around each event."""

import json

import pytest

from cluster.cli import main
from cluster.errors import InvalidInputError
from lab.bench.replay_elastic import parse_events

ARGS = ["--records", "3000", "--replicas", "4", "--hot-blocks", "48", "--warm-blocks", "96", "--policy", "cost",
        "--scale-events", "scale_in@40,scale_out@80,kill@110", "--scale-window-s", "20"]


def scale_lines(capsys, *extra):
    assert main(["replay", *ARGS, *extra]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    runs = {r["arm"]: r for r in lines if r["bench"] == "replay"}
    rows = {(r["arm"], r["event"]): r for r in lines if r["bench"] == "replay_scale"}
    return runs, rows


def test_events_change_the_replicas_and_only_elastic_arms_read_l3(capsys):
    runs, rows = scale_lines(capsys, "--scale-arms", "elastic,baseline,handoff_value,handoff_lru")
    assert sorted(runs) == ["baseline", "elastic", "handoff_lru", "handoff_value"]
    for arm in runs:
        assert [(rows[arm, e]["replicas_before"], rows[arm, e]["replicas_after"]) for e in
                ("scale_in", "scale_out", "kill")] == [(4, 3), (3, 4), (4, 3)]
        for e in ("scale_in", "scale_out", "kill"):   # every request in a window is counted once
            row = rows[arm, e]
            assert row["requests_after"] > 0 and row["requests_before"] > 0
            assert row["recomputed_tokens_after"] >= 0 and 0 <= row["hit_rate_after"] <= 1
    assert all(rows["baseline", e]["l3_hit_rate_after"] == 0 for e in ("scale_in", "scale_out", "kill"))
    # Write-behind put the killed replica's sessions in L3: the elastic arm reads them back.
    assert rows["elastic", "kill"]["l3_hit_rate_after"] > 0
    assert rows["elastic", "kill"]["recomputed_tokens_after"] < rows["baseline", "kill"]["recomputed_tokens_after"]
    assert rows["elastic", "scale_out"]["warmup_blocks"] > 0 and rows["baseline", "scale_out"]["warmup_blocks"] == 0
    # The budgeted arms write at most their budget (an eighth of HOT + WARM: 18 blocks).
    for arm in ("handoff_value", "handoff_lru"):
        assert 0 < rows[arm, "scale_in"]["handoff_l3_blocks"] <= 18
    # Before the first event every arm saw the same requests and the same caches.
    firsts = {rows[arm, "scale_in"]["recomputed_tokens_before"] for arm in runs}
    assert len(firsts) == 1


def test_the_same_run_twice_gives_the_same_lines(capsys):
    a = scale_lines(capsys, "--scale-arms", "elastic")[1]
    b = scale_lines(capsys, "--scale-arms", "elastic")[1]
    assert a == b


def test_bad_specs_are_refused():
    assert parse_events("kill@5,scale_in@1") == [(1.0, "scale_in"), (5.0, "kill")]
    with pytest.raises(InvalidInputError, match="unknown event 'explode'"):
        parse_events("explode@1")
    with pytest.raises(InvalidInputError, match="needs a time"):
        parse_events("kill")


def test_a_scale_in_hands_its_peers_the_sessions_used_last_as_the_product_does(monkeypatch):
    """The replay's hand-off follows ``actors.elastic``: L3 gets the leaving replica's blocks in
    value order, the survivors pull its most recently used sequences."""
    from cluster.cache.prefix_value import recent_prefixes, valuable_prefixes
    from cluster.cache.tiered import TierConfig
    from lab.bench import replay_elastic
    from lab.bench.replay_model import Replica

    config = TierConfig(hot_blocks=256, warm_blocks=0, block_tokens=1)
    victim, survivor = Replica("victim", config), Replica("survivor", config)
    finished = tuple(range(1000, 1064))   # a long session with many turns, ended
    under_way = tuple(range(2000, 2032))  # a short one, used last
    assert replay_elastic._install(victim, finished) == len(finished)
    for _ in range(5):   # its later turns: hits
        assert replay_elastic._install(victim, finished) == 0
    replay_elastic._install(victim, under_way)
    # The two orders disagree, so the test tells them apart.
    assert valuable_prefixes(victim.cache.tree)[0].tokens == finished
    assert recent_prefixes(victim.cache.tree)[0].tokens == under_way

    class Sim:
        indexes: list = []

        def publish(self, replica):
            pass

    class State:
        queued_tokens = 0

    monkeypatch.setattr(replay_elastic, "HANDOFF_PEER_PREFIXES", 1)
    events = replay_elastic.ScaleEvents([], "elastic", window_s=10.0, l3_blocks=1000, handoff_blocks=None,
                                        make_replica=None)
    facts = events._hand_off(Sim(), victim, [(survivor, State())])
    assert facts == {"handoff_l3_blocks": len(finished) + len(under_way), "handoff_peer_blocks": len(under_way)}
    assert survivor.cache.tree.match_prefix(list(under_way)).length == len(under_way)
    assert survivor.cache.tree.match_prefix(list(finished)).length == 0


def test_a_replica_whose_event_buffer_overflows_is_reloaded_from_its_snapshot(capsys, monkeypatch):
    """A publisher that drops events asks for a resync; the replay's index then loads the
    replica's snapshot (a ``Snapshot`` with its epoch), as the directory does, and the run goes on."""
    import functools

    from cluster.routing import index as index_module
    from lab.bench import replay_model

    monkeypatch.setattr(replay_model, "KVEventPublisher",
                        functools.partial(replay_model.KVEventPublisher, max_buffer_events=4))
    loaded = []
    real = index_module.GlobalIndex.load_snapshot

    def load_snapshot(self, worker_id, seq, entries):
        loaded.append(worker_id)
        return real(self, worker_id, seq, entries)
    monkeypatch.setattr(index_module.GlobalIndex, "load_snapshot", load_snapshot)
    runs, rows = scale_lines(capsys, "--scale-arms", "elastic")
    assert loaded, "no replica overflowed its event buffer: the test does not reach the snapshot path"
    assert [(rows["elastic", e]["replicas_before"], rows["elastic", e]["replicas_after"])
            for e in ("scale_in", "scale_out", "kill")] == [(4, 3), (3, 4), (4, 3)]
