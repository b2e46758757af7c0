import os
from typing import NamedTuple

import pytest
import torch

from cluster.cache.kv_pool import KVLayout
from cluster.cache.radix_tree import COLD, HOT, WARM
from cluster.cache.tiered import TierConfig, TieredCache, UnknownSessionError
from cluster.errors import DiskTierError, InvalidInputError
from tests.unit.helpers import TickClock

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4)




def kv_for(tokens):
    """Deterministic KV per (prefix) position, so content checks are exact."""
    g = torch.Generator().manual_seed(hash(tuple(tokens)) % (2 ** 31))
    return torch.randn(LAYOUT.num_layers, 2, len(tokens), 1, 4, generator=g)


def make(tmp_path, hot=8, warm=8, cold=16, **kw):
    cfg = TierConfig(hot_blocks=hot, warm_blocks=warm, cold_blocks=cold, block_tokens=4,
                     disk_dir=str(tmp_path) if cold else None, device="cpu", **kw)
    return TieredCache(cfg, LAYOUT, clock=TickClock())


def put(cache, tokens, namespace=None, kv=None):
    """Cache ``tokens`` with their KV (what a request's lease does); returns the node of the last token."""
    lease = cache.admit(tokens, namespace, compute_last=False)
    try:
        if lease.cached_tokens < len(tokens):
            lease.append((kv_for(tokens) if kv is None else kv)[:, :, lease.cached_tokens:])
            return lease.commit(tokens)
        return lease._node
    finally:
        lease.release()


class Match(NamedTuple):
    length: int
    tier_lengths: list
    promoted_tokens: int
    kv: torch.Tensor


def match(cache, tokens, namespace=None):
    """The tiers ``tokens`` are cached in, then a lease on them (promoting what
    it finds to HOT), its KV read and the lease released."""
    tiers = list(cache.lookup(tokens, namespace).tier_lengths)
    lease = cache.admit(tokens, namespace, compute_last=False)
    try:
        return Match(lease.cached_tokens, tiers, lease.promoted_tokens,
                     lease.read() if cache.layout is not None else None)
    finally:
        lease.release()


def demote(cache, node, to):
    while node.tier < to:
        move = cache.moves.start_demotion(node)
        assert move is not None
        cache.moves.wait(move)


def test_round_trip_hot_warm_cold_hot_is_bit_exact(tmp_path):
    cache = make(tmp_path)
    toks = list(range(10))
    node = put(cache, toks)
    expected = kv_for(toks)
    demote(cache, node, WARM)
    assert node.tier == WARM and cache.pools[WARM].allocator.used_tokens == 10
    assert torch.equal(cache.pools[WARM].read(node.extents), expected)
    demote(cache, node, COLD)
    assert node.tier == COLD and cache.pools[WARM].allocator.used_tokens == 0
    m = match(cache, toks)
    assert m.tier_lengths == [0, 0, 10] and m.length == 10 and m.promoted_tokens == 10
    assert node.tier == HOT
    assert torch.equal(m.kv, expected)
    cache.check_invariants()
    cache.close()


def test_bfloat16_kv_round_trips_through_the_disk_tier(tmp_path):
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype="bfloat16")
    cfg = TierConfig(hot_blocks=8, warm_blocks=8, cold_blocks=16, block_tokens=4, disk_dir=str(tmp_path), device="cpu")
    cache = TieredCache(cfg, layout, clock=TickClock())
    toks = list(range(10))
    node = put(cache, toks, kv=kv_for(toks).to(torch.bfloat16))
    demote(cache, node, COLD)
    m = match(cache, toks)
    assert m.tier_lengths == [0, 0, 10] and torch.equal(m.kv, kv_for(toks).to(torch.bfloat16))
    cache.close()


def test_a_failing_disk_write_drops_instead_of_retrying_forever(tmp_path, monkeypatch):
    """Making room in WARM when every copy to COLD fails (EIO, say): the WARM nodes are
    dropped, once each, and the room is made; nothing retries the same failing write."""
    cache = make(tmp_path, hot=8, warm=2, cold=8)
    nodes = [put(cache, [i] * 4) for i in range(2)]
    for node in nodes:
        demote(cache, node, WARM)
    assert cache.pools[WARM].allocator.free_blocks == 0
    writes = []

    def failing_write(extents, kv):
        writes.append(len(extents))
        raise DiskTierError("EIO")

    monkeypatch.setattr(cache.pools[COLD], "write", failing_write)
    assert cache.moves.make_room(WARM, 2)
    assert writes == [1, 1] and not any(n.alive for n in nodes)
    assert cache.stats["demotion_failures"] == 2 and cache.stats["dropped_tokens"] == 8
    cache.check_invariants()
    cache.close()


def test_disk_corruption_is_detected_and_the_subtree_dropped(tmp_path):
    cache = make(tmp_path)
    parent = put(cache, list(range(8)))
    child = put(cache, list(range(8)) + [50, 51, 52])
    for n in (child, parent):
        demote(cache, n, COLD)
    cache.pools[COLD].corrupt_block_for_test(parent.extents[0].block_id)
    m = match(cache, list(range(8)) + [50, 51, 52])
    assert m.length == 0 and m.kv.shape[2] == 0
    assert not parent.alive and not child.alive
    assert cache.stats["checksum_failures"] == 1
    cache.check_invariants()
    # The cache still works: the same tokens can be inserted again and read back.
    put(cache, list(range(8)))
    m = match(cache, list(range(8)))
    assert torch.equal(m.kv, kv_for(list(range(8))))
    cache.close()


def test_watermark_demotes_lru_first_and_never_locked(tmp_path):
    # 8 HOT blocks of 4 tokens = 32 tokens; high 0.9 -> demote above 28.8 tokens, down to < 22.4.
    cache = make(tmp_path, hot=8, warm=16, cold=0)
    nodes = [put(cache, [100 + i] * 4) for i in range(6)]   # 24 tokens, under the mark
    match(cache, [100] * 4)                                   # node 0 becomes most recent
    cache.tree.lock(nodes[1])
    nodes.append(put(cache, [200] * 4))                      # 28 tokens
    assert all(n.tier == HOT for n in nodes)
    nodes.append(put(cache, [201] * 4))                      # 32 tokens > 28.8: demote to below 22.4
    cache.wait_all()
    cache.poll()
    tiers = [n.tier for n in nodes]
    # LRU order skips 0 (touched) and 1 (locked): 2, 3, 4 go, leaving 20 < 22.4 tokens HOT.
    assert tiers == [HOT, HOT, WARM, WARM, WARM, HOT, HOT, HOT]
    assert cache.stats["demoted_to_warm"] == 3
    cache.check_invariants()
    cache.close()


def test_a_background_demotion_never_waits_for_room_below_the_lower_tier_drains_instead(tmp_path):
    """HOT over its high watermark while WARM has one free block: the demotion that cannot fit
    stays in HOT (nothing on the engine thread waits for WARM's copy to the disk), WARM starts
    demoting as much to COLD, and once that copy lands the next watermark pass moves HOT's nodes."""
    cache = make(tmp_path, hot=8, warm=8, cold=16)   # 32 / 32 / 64 tokens, watermarks 0.9 / 0.7
    warm = [put(cache, [10 + i] * 4) for i in range(7)]
    for node in warm:                                # WARM at 28 of 32 tokens: under its watermark
        demote(cache, node, WARM)
    hot = [put(cache, [50 + i] * 8) for i in range(3)]   # 24 HOT tokens, under the mark
    waits = []
    real_wait = cache.moves.wait
    cache.moves.wait = lambda move: waits.append(move) or real_wait(move)
    hot.append(put(cache, [60] * 8))                 # 32 > 28.8: the two LRU nodes should go down
    assert waits == [] and cache.stats["stalls"] == 0   # nothing waited for a copy, nothing made room
    # WARM's free block held neither 8-token node: WARM started demoting its 3 LRU nodes (12 tokens,
    # 16 free after) to COLD instead. That copy may land while put runs, a later pass move HOT's
    # nodes down and WARM's own watermark push more of it, asynchronously too.
    going = [n.tier == COLD or (n.busy is not None and n.busy.dst_tier == COLD) for n in warm]
    assert going[:3] == [True] * 3
    cache.moves.wait = real_wait
    cache.wait_all()
    cache.poll()
    cache.space.enforce_watermarks()
    cache.wait_all()
    cache.poll()
    assert [n.tier for n in hot] == [WARM, WARM, HOT, HOT]
    assert cache.stats["dropped_tokens"] == 0
    for i in range(3):                               # all of it still readable, from whichever tier
        assert torch.equal(match(cache, [50 + i] * 8).kv, kv_for([50 + i] * 8))
    cache.check_invariants()
    cache.close()


def test_demotion_is_abandoned_when_the_node_gets_locked(tmp_path):
    cache = make(tmp_path, cold=0)
    node = put(cache, list(range(6)))
    move = cache.moves.start_demotion(node)
    cache.tree.lock(node)
    cache.moves.wait(move)
    assert node.tier == HOT and cache.stats["demotions_abandoned"] == 1
    assert cache.pools[WARM].allocator.used_tokens == 0
    cache.tree.unlock(node)
    cache.check_invariants()
    cache.close()


def test_promotion_brings_the_whole_path(tmp_path):
    cache = make(tmp_path)
    a = put(cache, [1, 2, 3, 4, 5])
    b = put(cache, [1, 2, 3, 4, 5, 6, 7])
    c = put(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    demote(cache, c, COLD)
    demote(cache, b, WARM)
    demote(cache, a, WARM)
    m = match(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    assert m.tier_lengths == [0, 7, 3]
    assert [a.tier, b.tier, c.tier] == [HOT, HOT, HOT] and m.length == 10
    assert torch.equal(m.kv[:, :, 7:], kv_for([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])[:, :, 7:])
    cache.check_invariants()
    cache.close()


def test_promotion_without_room_reports_only_the_hot_part(tmp_path):
    cache = make(tmp_path, hot=2, warm=8, cold=0, high_watermark=1.0, low_watermark=0.5)
    a = put(cache, [1, 2, 3, 4])
    b = put(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    demote(cache, b, WARM)
    cache.tree.lock(a)
    filler = put(cache, [9, 9, 9, 9])
    cache.tree.lock(filler)
    m = match(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    assert m.length == 4 and m.tier_lengths == [4, 4, 0] and b.tier == WARM
    assert cache.stats["promotion_skipped_no_room"] == 1
    cache.check_invariants()
    cache.close()


def test_prefetch_runs_in_the_background(tmp_path):
    cache = make(tmp_path)
    toks = list(range(12))
    node = put(cache, toks)
    cache.sessions.note("s1", toks)
    demote(cache, node, COLD)
    started = cache.prefetch("s1")
    assert started == 12 and node.busy  # returned before the copy finished
    cache.wait_all()
    assert node.tier == HOT
    m = match(cache, toks)
    assert m.promoted_tokens == 0 and m.length == 12
    assert torch.equal(m.kv, kv_for(toks))
    with pytest.raises(UnknownSessionError, match="unknown session 'nope'"):
        cache.prefetch("nope")
    assert cache.stats["prefetch_unknown_session"] == 1
    cache.check_invariants()
    cache.close()


def test_a_prefetch_pushes_out_only_idle_prefixes_no_waiting_request_or_prefetch_touched():
    """HOT 8 blocks (32 tokens; a prefetch leaves a block free under the high watermark).
    A returning session's 12 tokens are in WARM; HOT holds an idle prefix and one a
    waiting request touched at its submit (``touch``; the engine sets ``waiting_since``).
    The prefetch pushes the idle one down and nothing else. With every HOT prefix a
    waiting request's, or a prefetch's of the last few seconds, it does nothing (counted)."""
    def cache_with(session):
        cache = TieredCache(TierConfig(hot_blocks=8, warm_blocks=32, block_tokens=4, device="cpu"), LAYOUT,
                            clock=TickClock())
        put(cache, session)
        cache.sessions.note("s", session)
        cache.demote_path(session, None, WARM)
        return cache

    session, idle_toks, waiting_toks = [1, 2, 3] * 4, [50 + i for i in range(12)], [80 + i for i in range(12)]
    cache = cache_with(session)
    idle, waiting = put(cache, idle_toks), put(cache, waiting_toks)
    cache.waiting_since = cache.touch(waiting_toks)
    assert cache.prefetch("s") == 12
    cache.wait_all()
    cache.poll()
    assert (idle.tier, waiting.tier, cache.lookup(session).tier_lengths) == (WARM, HOT, [12, 0, 0])
    assert cache.stats["prefetch_skipped_no_room"] == 0
    cache.check_invariants()
    cache.close()

    cache = cache_with(session)
    first = put(cache, idle_toks)
    cache.waiting_since = cache.touch(idle_toks)     # both HOT prefixes are waiting requests'
    second = put(cache, waiting_toks)
    cache.touch(waiting_toks)
    assert cache.prefetch("s") == 0 and cache.stats["prefetch_skipped_no_room"] == 1
    assert cache.lookup(session).tier_lengths == [0, 12, 0] and [first.tier, second.tier] == [HOT, HOT]
    cache.waiting_since = None                         # admitted and finished: now they are idle
    assert cache.prefetch("s") == 12
    cache.wait_all()
    cache.poll()
    cache.check_invariants()
    cache.close()


def test_match_waits_for_a_prefetch_in_flight(tmp_path):
    cache = make(tmp_path)
    toks = list(range(9))
    node = put(cache, toks)
    demote(cache, node, COLD)
    cache.prefetch(tokens=toks)
    m = match(cache, toks)          # no second promotion: it waits for the first
    assert m.length == 9 and m.promoted_tokens == 0 and cache.stats["promotions"] == 1
    cache.close()


def test_disk_full_drops_the_coldest(tmp_path):
    cache = make(tmp_path, hot=8, warm=2, cold=2)
    nodes = [put(cache, [i] * 8) for i in range(3)]
    demote(cache, nodes[0], COLD)
    match(cache, [1] * 8)
    demote(cache, nodes[1], WARM)
    # COLD is full (2 blocks): moving node 1 down drops node 0, the coldest.
    demote(cache, nodes[1], COLD)
    assert not nodes[0].alive and nodes[1].tier == COLD
    assert cache.stats["dropped_tokens"] == 8
    cache.check_invariants()
    cache.close()


@pytest.mark.parametrize("kw, message", [
    (dict(high_watermark=0.5, low_watermark=0.7), "watermarks out of order"),
    (dict(high_watermark=1.5), "watermarks out of order"),
    (dict(hot_blocks=0), "hot_blocks"),
    (dict(warm_blocks=0, cold_blocks=4, disk_dir="/tmp"), "needs warm_blocks"),
])
def test_bad_config_is_rejected(kw, message):
    base = dict(hot_blocks=4, warm_blocks=4, device="cpu")
    with pytest.raises(InvalidInputError, match=message):
        TierConfig(**{**base, **kw})


def test_cold_without_a_directory_lives_in_the_users_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = TieredCache(TierConfig(hot_blocks=4, warm_blocks=4, cold_blocks=4, device="cpu"), LAYOUT)
    try:
        assert cache.config.disk_dir == str(tmp_path / "prefix-cache" / "cold")
        assert [p.name for p in (tmp_path / "prefix-cache" / "cold").iterdir()] == [f"cold-{os.getpid()}.kvblocks"]
    finally:
        cache.close()
    assert list((tmp_path / "prefix-cache" / "cold").iterdir()) == []   # the file goes with the cache


# One block of LAYOUT in float32: 2 layers x K,V x 16 tokens x 1 head x 4 dims x 4 bytes.
BLOCK_BYTES = 2 * 2 * 16 * 1 * 4 * 4


def test_kv_memory_is_one_budget_split_by_the_cache_and_cold_is_on(tmp_path):
    mb = 64 * BLOCK_BYTES / (1 << 20)   # 64 blocks of memory
    cache = TieredCache(TierConfig(kv_memory_mb=mb, disk_dir=str(tmp_path), device="cpu"), LAYOUT)
    try:
        c = cache.config
        assert (c.hot_blocks, c.warm_blocks) == (56, 8)          # 7/8 HOT, the rest WARM: the same bytes
        assert c.cold_blocks == 4 * 64 and c.kv_memory_mb is None  # COLD 4x the budget on disk
        assert [p.allocator.num_blocks for p in cache.pools] == [56, 8, 256]
    finally:
        cache.close()
    # cold_mb: 0 turns COLD off; a disk_dir that does not exist is named.
    cache = TieredCache(TierConfig(kv_memory_mb=mb, cold_mb=0, device="cpu"), LAYOUT)
    try:
        assert [p.allocator.num_blocks for p in cache.pools] == [56, 8]
    finally:
        cache.close()
    with pytest.raises(InvalidInputError, match="disk_dir '/nonexistent/cold' .*No such file"):
        TieredCache(TierConfig(kv_memory_mb=mb, disk_dir="/nonexistent/cold", device="cpu"), LAYOUT)
    # int8 below HOT: the same WARM bytes hold more blocks; an explicit COLD size is kept.
    cache = TieredCache(TierConfig(kv_memory_mb=mb, cold_blocks=5, disk_dir=str(tmp_path), device="cpu",
                                   tier_codec="int8"), LAYOUT)
    try:
        assert cache.config.hot_blocks == 56 and cache.config.warm_blocks > 8 and cache.config.cold_blocks == 5
    finally:
        cache.close()


@pytest.mark.parametrize("kw, message", [
    (dict(kv_memory_mb=1, hot_blocks=4), "kv_memory_mb or hot_blocks, not both"),
    (dict(kv_memory_mb=0), "kv_memory_mb must be a positive number"),
    (dict(kv_memory_mb="1g"), "kv_memory_mb must be a positive number"),
    (dict(kv_memory_mb=True), "kv_memory_mb must be a positive number"),
])
def test_bad_memory_budget_is_rejected_naming_the_key(kw, message):
    with pytest.raises(InvalidInputError, match=message):
        TierConfig(**{"device": "cpu", **kw})


def test_on_a_cpu_cache_warm_beside_a_memory_budget_is_an_error_naming_both(tmp_path):
    with pytest.raises(InvalidInputError, match="kv_memory_mb is HOT and WARM together on a CPU cache"):
        TieredCache(TierConfig(kv_memory_mb=1, warm_blocks=4, disk_dir=str(tmp_path), device="cpu"), LAYOUT)


def test_missing_or_unwritable_disk_directory(tmp_path, monkeypatch):
    with pytest.raises(DiskTierError, match="does not exist"):
        make(tmp_path / "missing")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.geteuid() == 0:   # root may write anywhere: the permission check answers as it would for anyone else
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: real_access(path, mode) and not (
            os.path.samefile(path, ro) and mode & os.W_OK))
    with pytest.raises(DiskTierError, match="not writable"):
        make(ro)


def test_truncated_disk_file_is_a_checksum_failure(tmp_path):
    cache = make(tmp_path)
    node = put(cache, list(range(8)))
    demote(cache, node, COLD)
    os.truncate(cache.pools[COLD].path, 0)
    m = match(cache, list(range(8)))
    assert m.length == 0 and cache.stats["checksum_failures"] == 1
    cache.check_invariants()
    cache.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip_through_pinned_host(tmp_path):
    cfg = TierConfig(hot_blocks=8, warm_blocks=8, cold_blocks=8, block_tokens=4, disk_dir=str(tmp_path))
    cache = TieredCache(cfg, LAYOUT, clock=TickClock())
    assert cache.hot.tensor.is_cuda and cache.pools[WARM].tensor.is_pinned()
    toks = list(range(10))
    node = put(cache, toks)
    demote(cache, node, COLD)
    m = match(cache, toks)
    assert torch.equal(m.kv.cpu(), kv_for(toks))
    cache.close()


def test_simulation_mode_without_payload_moves_at_once():
    cfg = TierConfig(hot_blocks=4, warm_blocks=4, cold_blocks=4, block_tokens=1, device="cpu")
    cache = TieredCache(cfg, None, clock=TickClock())
    for i in range(3):
        lease = cache.admit([i, i], compute_last=False)
        lease.extend(2)
        lease.commit([i, i])
    cache.poll()
    # 6 tokens for 4 HOT slots: each insert past 90% pushed the LRU node down a tier
    # (and WARM, full in turn, pushed its oldest to COLD), with no copies involved.
    tiers = [cache.tree.match_prefix([i, i]).nodes[-1].tier for i in range(3)]
    assert tiers == [COLD, WARM, HOT]
    m = match(cache, [0, 0])
    assert m.length == 2 and cache.tree.match_prefix([0, 0]).nodes[-1].tier == HOT
    cache.check_invariants()


class Recorder:
    def __init__(self):
        self.events = []

    def on_stored(self, node):
        self.events.append(("stored", len(node.key), node.tier))

    def on_tier(self, node, old):
        self.events.append(("tier", old, node.tier))

    def on_removed(self, node):
        self.events.append(("removed", len(node.key), node.tier))


def test_listeners_see_stored_tier_changes_and_removals(tmp_path):
    cache = make(tmp_path, cold=0)
    rec = Recorder()
    cache.tree.listeners.append(rec)
    node = put(cache, list(range(6)))
    demote(cache, node, WARM)
    match(cache, list(range(6)))
    cache.tree.drop(node)
    assert rec.events == [("stored", 6, HOT), ("tier", HOT, WARM), ("tier", WARM, HOT), ("removed", 6, HOT)]
    assert cache.tree.namespace_of(cache.tree.root("t")) == "t"


def test_idle_compaction_moves_only_idle_nodes_and_keeps_kv(tmp_path):
    cache = make(tmp_path, hot=8, warm=8, cold=0, high_watermark=1.0, low_watermark=0.5)
    nodes = [put(cache, [50 + i, 1]) for i in range(8)]     # 2-token nodes packed as slots
    for n in nodes[::2]:
        cache.tree.drop(n)
    locked = nodes[1]
    cache.tree.lock(locked)
    before = list(locked.extents)
    freed = cache.compact_idle(8)
    # Four half-full blocks of 2-token slots: the four live nodes fit in two, the locked one unmoved.
    assert freed == 2 and cache.stats["compacted_blocks"] == 2 and cache.hot.allocator.used_blocks == 2
    assert locked.extents == before
    for n in nodes[1::2]:
        toks = cache.tree.path_tokens(n)
        m = match(cache, toks)
        assert torch.equal(m.kv, kv_for(toks))
    cache.tree.unlock(locked)
    cache.check_invariants()
    cache.close()


def test_a_checkpoint_that_fills_hot_keeps_the_lease_kv_in_hot(tmp_path):
    """Inserting a checkpoint can push HOT over its watermark; the new nodes are the
    lease's own KV, locked before the watermark runs, so none of it leaves HOT."""
    cache = make(tmp_path, hot=8, warm=16, cold=0)   # 32 HOT tokens, high watermark 0.9
    tokens = list(range(1, 31))                        # 30 tokens: 8 blocks, over the mark
    lease = cache.admit(tokens, compute_last=False)
    lease.append(kv_for(tokens))
    lease.checkpoint(tokens)
    cache.wait_all()
    cache.poll()
    assert cache.lookup(tokens).tier_lengths[HOT] == 30 and cache.stats["demoted_to_warm"] == 0
    assert torch.equal(lease.read(), kv_for(tokens))
    lease.commit(tokens)
    cache.check_invariants()
    cache.close()


def test_a_checkpoint_beside_a_moving_copy_keeps_its_own_kv(tmp_path):
    """Another request cached the same tokens and they are being promoted back from
    WARM: the tree would keep that moving copy and free the lease's, so the lease
    keeps its own (the commit inserts it) and nothing fails."""
    cache = make(tmp_path, hot=16, warm=16, cold=0)
    tokens = list(range(1, 13))
    lease = cache.admit(tokens, compute_last=False)        # B: nothing cached yet
    lease.append(kv_for(tokens))
    node = put(cache, tokens)                              # A computed and cached them meanwhile
    demote(cache, node, WARM)
    move = cache.moves.start_promotion([node], background=True)
    assert move is not None and node.busy
    lease.checkpoint(tokens)
    assert cache.stats["checkpoints_deferred"] == 1
    assert torch.equal(lease.read(), kv_for(tokens))
    cache.moves.wait(move)
    lease.commit(tokens)
    found = match(cache, tokens)
    assert found.length == 12 and torch.equal(found.kv, kv_for(tokens))
    cache.check_invariants()
    cache.close()


def test_ready_recomputes_only_where_the_measured_copy_is_slower_and_measures_again():
    """A WARM prefix of 12 tokens. Without a measured copy rate, or with one at most 1.25x
    the prefill cost, ``ready`` promotes. Measured slower than that, it answers ready with
    ``recompute`` set and admitting without promotion leaves those tokens to compute,
    reported as held; every eighth such case promotes anyway, to measure again."""
    cache = TieredCache(TierConfig(hot_blocks=16, warm_blocks=32, block_tokens=4, device="cpu"), LAYOUT,
                        clock=TickClock(), deterministic_io=True)
    toks = list(range(12))
    put(cache, toks)
    cache.demote_path(toks, None, WARM)
    assert cache.ready(toks + [99], recompute_s_per_token=1e-3)[:2] == (False, [0, 12, 0])   # nothing measured
    cache.wait_all()
    cache.poll()
    cache.demote_path(toks, None, WARM)
    cache.promote_s_per_token[WARM] = 1.2e-3                      # within the margin: promote
    assert cache.ready(toks + [99], recompute_s_per_token=1e-3).recompute == 0
    cache.wait_all()
    cache.poll()
    cache.demote_path(toks, None, WARM)
    cache.promote_s_per_token[WARM] = 5e-3                        # measured 5x slower than computing
    answers = [cache.ready(toks + [99], recompute_s_per_token=1e-3) for _ in range(8)]
    assert [a.ready for a in answers] == [True] * 7 + [False]     # the eighth promotes (to measure)
    assert answers[0].recompute == 12 and answers[7].recompute == 0
    assert (cache.stats["promotions_recompute_cheaper"], cache.stats["promotions_partial"]) == (7, 0)
    cache.wait_all()
    cache.poll()
    cache.demote_path(toks, None, WARM)
    lease = cache.admit(toks + [99], promote=False)
    assert (lease.cached_tokens, lease.held_by_tier, lease.missed_by_tier) == (0, (0, 12, 0), (0, 12, 0))
    lease.release()
    cache.check_invariants()
    cache.close()


def test_a_node_larger_than_warm_moves_down_in_parts_and_a_waiting_prompt_gets_its_room(tmp_path):
    """A committed prompt of 7 blocks over a WARM of 4: whole, it could never move down, and
    HOT would stay full with every new prompt waiting (measured: 26 requests stalled on an
    idle engine). Cut to what fits, it moves down part by part (through WARM to COLD), exactly."""
    cache = make(tmp_path, hot=8, warm=4, cold=32)
    try:
        old = list(range(1, 29))                         # 7 blocks of 4 tokens
        put(cache, old)
        assert cache.lookup(old).tier_lengths == [28, 0, 0]
        new = list(range(100, 128))                      # another 7 blocks: HOT must give 6
        put(cache, new)
        assert cache.lookup(new).tier_lengths == [28, 0, 0]
        hot, warm, cold = cache.lookup(old).tier_lengths
        assert hot + warm + cold == 28 and hot < 28      # moved down in parts, nothing dropped
        assert cache.stats["dropped_tokens"] == 0 and cache.stats["demotion_splits"] >= 1
        cache.check_invariants()
        got = match(cache, old)                          # and it comes back whole and exact
        assert got.length == 28 and torch.equal(got.kv, kv_for(old))
    finally:
        cache.close()
