"""L3 in the tiered cache: write behind at commit, fetch ahead before admission,
exact outputs from fetched KV, and the guards (a bad block, a full HOT pool, a
slow store, a full write queue). Two caches sharing one in-process store stand
for two replicas; tests/distributed runs the same over a real Mooncake master."""

import random
import time

import pytest
import torch

from cluster.cache.kv_pool import KVLayout
from cluster.cache.prefix_value import prefix_value, shared_prefixes
from cluster.cache.l3.memory import MemoryL3Store
from cluster.cache.l3.tier import L3Tier, L3TierConfig
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.engine.model import DecoderModel, ModelConfig
from cluster.engine.engine import Engine, EngineRequest, SamplingParams
from cluster.errors import InvalidInputError
from cluster.hashing import block_hashes
from tests.unit.reference_forward import forward_one

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BT = 8


def toks(seed: int, n: int) -> list[int]:
    """``n`` token ids of the tiny test vocabulary (259), one sequence per seed."""
    g = random.Random(seed)
    return [g.randrange(1, 250) for _ in range(n)]


@pytest.fixture(scope="module")
def model():
    return DecoderModel(ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                    intermediate_size=128, seed=3))


class Listener:
    def __init__(self):
        self.stored, self.removed, self.inventories = [], [], []

    def on_l3_inventory(self, hashes):
        self.inventories.append(sorted(hashes))

    def on_l3_stored(self, hashes, namespace=None):
        self.stored.extend(hashes)

    def on_l3_removed(self, hashes):
        self.removed.extend(hashes)


def make(model, store, hot=64, warm=0, **l3kw):
    c = model.config
    layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim)
    cache = TieredCache(TierConfig(hot_blocks=hot, warm_blocks=warm, block_tokens=BT, device="cpu"), layout)
    tier = L3Tier(store, layout, BT, L3TierConfig(model_id="test-model", **l3kw), start_thread=False)
    listener = Listener()
    tier.listeners.append(listener)
    cache.attach_l3(tier)
    return Engine(model, cache, keep_logits=True), tier, listener


def run(engine, tier, prompt, max_tokens=3, namespace=None):
    """Generate to the end, doing the L3 I/O whenever the engine waits for it."""
    req = engine.submit(EngineRequest(list(prompt), SamplingParams(max_tokens=max_tokens), namespace=namespace))
    while not req.finished:
        engine.step()
        tier.run_pending()
    engine.complete_finished()
    tier.run_pending()
    engine.cache.apply_l3()
    return req


def full_logits(model, tokens):
    return forward_one(model, torch.tensor(tokens), 0, None)[0]


def assert_exact(model, req):
    ref = full_logits(model, req.prompt + req.output)
    got = torch.cat(req.logits, dim=0)
    start = req.cached_tokens
    assert torch.allclose(got, ref[start:start + got.shape[0]], atol=1e-4, rtol=0)


def test_a_turn_written_on_one_replica_is_read_on_another_exactly(model):
    store = MemoryL3Store()
    a, tier_a, heard_a = make(model, store)
    b, tier_b, _ = make(model, store)
    prompt = toks(1, 42)                       # 42 tokens
    first = run(a, tier_a, prompt, max_tokens=5)      # commits 42 + 5 = 47 tokens: 5 full blocks and 7
    seq = prompt + first.output
    hashes = block_hashes(seq[:40], BT)
    assert store.num_values == 6 and heard_a.stored == hashes   # the partial block: no event
    assert tier_a.stats.blocks_written == 5 and tier_a.stats.tails_written == 1
    assert tier_a.stats.writes_queued == 6

    follow = seq + [7, 8, 9, 10, 11, 12]              # the next turn lands on the other replica
    second = run(b, tier_b, follow)
    assert second.cached_tokens == 47                 # five whole blocks and the partial one from L3
    assert second.tier_hits == [0, 0, 0, 47]          # from L3 (installed into HOT before admission)
    assert tier_b.stats.fetches == 1 and tier_b.stats.fetch_blocks_hit == 5 and tier_b.stats.tails_fetched == 1
    assert tier_b.stats.installed_tokens == 47
    assert_exact(model, second)
    # b wrote only what L3 lacked: of the 53 + 3 tokens it committed, blocks 5 and 6 (no partial one).
    assert tier_b.stats.writes_queued == 2 and store.num_values == 8


def test_only_the_leading_run_of_verified_blocks_is_used(model):
    store = MemoryL3Store()
    a, tier_a, _ = make(model, store)
    b, tier_b, heard_b = make(model, store)
    prompt = toks(100, 48)                    # 48 tokens: 6 blocks
    run(a, tier_a, prompt, max_tokens=1)
    hashes = block_hashes(prompt, BT)
    store.corrupt(tier_a.key(hashes[3]))              # block 3 fails its checksum
    second = run(b, tier_b, prompt + [1, 2, 3])
    assert second.cached_tokens == 24                 # blocks 0-2 only
    assert heard_b.removed == [hashes[3]]             # the directory hears block 3 is not usable
    assert store.stats().verify_failures == 1
    # ... and it was removed from L3 (every read of it would fail), counted; b computed
    # blocks 3-5 and wrote them, so L3 now holds a sound block 3: a third replica reads all 6.
    assert tier_b.stats.verify_failed_removed == 1 and tier_b.stats.writes_queued == 3 + 1   # and its 4-token tail
    c, tier_c, _ = make(model, store)
    assert run(c, tier_c, prompt + [4, 5]).cached_tokens == 48
    assert_exact(model, second)


class Unanswering(MemoryL3Store):
    """A store whose reads time out (a master that does not answer in time)."""

    def get_blocks(self, lookups):
        from cluster.cache.l3 import GetStatus, L3GetResult
        return tuple(L3GetResult(q.key, GetStatus.TIMEOUT) for q in lookups)


def test_an_unanswered_fetch_marks_nothing_missing_and_tells_nobody(model):
    store = Unanswering()
    a, tier_a, _ = make(model, store)
    prompt = toks(150, 40)
    run(a, tier_a, prompt, max_tokens=1)                  # written: L3 has all 5 blocks
    b, tier_b, heard_b = make(model, store)
    first = run(b, tier_b, prompt + [4])
    assert first.cached_tokens == 0                        # computed: the store did not answer
    assert tier_b.stats.fetch_unanswered == 1 and tier_b.stats.fetch_misses == 0
    assert heard_b.removed == []                           # no false "removed" for the directory
    run(b, tier_b, prompt + [4, 5])                       # not asked again at once (a local back-off) ...
    assert tier_b.stats.fetches == 1 and heard_b.removed == []
    assert tier_a.unwritten(block_hashes(prompt, BT)) == []   # ... and what was written stays known written


def test_an_inventory_lists_the_store_or_else_sends_what_is_known(model):
    store = MemoryL3Store()
    a, tier_a, _ = make(model, store)
    run(a, tier_a, toks(160, 40), max_tokens=1)           # 5 blocks
    run(a, tier_a, toks(161, 24), max_tokens=1)           # 3 more
    b, tier_b, heard_b = make(model, store)
    tier_b.request_inventory()
    tier_b.request_inventory()                             # one listing queued, not two
    tier_b.run_pending()
    tier_b.take_written()
    expected = sorted(block_hashes(toks(160, 40), BT) + block_hashes(toks(161, 24), BT))
    assert heard_b.inventories == [expected]
    assert tier_b.stats.inventories == 1 and tier_b.stats.inventory_listed is True
    assert tier_b.unwritten(expected) == []                # listed blocks are not written again

    class Unlisting(MemoryL3Store):
        def list_names(self, prefix):
            return None
    c, tier_c, heard_c = make(model, Unlisting())
    run(c, tier_c, toks(162, 16), max_tokens=1)
    tier_c.request_inventory()
    tier_c.run_pending()
    tier_c.take_written()
    assert heard_c.inventories == [sorted(block_hashes(toks(162, 16), BT))]
    assert tier_c.stats.inventory_listed is False


def test_tenants_never_read_each_others_blocks(model):
    store = MemoryL3Store()
    a, tier_a, _ = make(model, store)
    b, tier_b, _ = make(model, store)
    prompt = toks(200, 40)
    run(a, tier_a, prompt, max_tokens=1, namespace="tenant-a")
    other = run(b, tier_b, prompt + [1], namespace="tenant-b")
    assert other.cached_tokens == 0 and tier_b.stats.fetch_misses == 1
    same = run(b, tier_b, prompt + [1, 2], namespace="tenant-a")
    assert same.cached_tokens == 40


def test_no_fetch_when_recompute_is_faster_or_the_gap_is_short(model):
    store = MemoryL3Store()
    a, tier_a, _ = make(model, store)
    run(a, tier_a, toks(300, 40), max_tokens=1)
    b, tier_b, _ = make(model, store)
    tier_b.set_rates(fetch_tokens_per_s=1_000.0, prefill_tokens_per_s=50_000.0)
    slow = run(b, tier_b, toks(300, 40) + [5])
    assert slow.cached_tokens == 0 and tier_b.stats.fetches == 0 and tier_b.stats.fetch_skipped_slower >= 1
    c, tier_c, _ = make(model, store, min_fetch_blocks=3)
    short = run(c, tier_c, toks(300, 16) + [5])   # two blocks past an empty tree: under 3
    assert short.cached_tokens == 0 and tier_c.stats.fetches == 0


def test_a_missing_block_is_not_asked_for_again_within_its_ttl(model):
    store = MemoryL3Store()
    b, tier_b, _ = make(model, store)
    prompt = toks(400, 40)
    run(b, tier_b, prompt, max_tokens=1)   # a miss, then b writes it
    assert tier_b.stats.fetches == 1 and tier_b.stats.fetch_misses == 1
    b.cache.drop_all()
    store.remove(tier_b.key(block_hashes(prompt, BT)[0]))
    tier_b.written.discard(block_hashes(prompt, BT)[0])
    again = run(b, tier_b, prompt + [9])
    assert again.cached_tokens == 0 and tier_b.stats.fetches == 1   # remembered as missing


def fetched_without_room(model):
    """A's 48-token prompt in L3; B's HOT (8 blocks) mostly held by a running request when B's
    request for the same prompt (and one token) fetches it: (B, its tier, the prompt, the blocker)."""
    store = MemoryL3Store()
    a, tier_a, _ = make(model, store)
    prompt = toks(500, 48)
    run(a, tier_a, prompt, max_tokens=1)
    b, tier_b, _ = make(model, store, hot=8)
    blocker = b.cache.admit(toks(900, 40), compute_last=False)   # holds 5 of 8 HOT blocks
    blocker.reserve(40)
    blocker.write(torch.zeros(2, 2, 40, 2, 16))
    result = b.cache.ready(prompt + [1], None)
    assert result[0] is False and tier_b.stats.fetches == 1
    tier_b.run_pending()
    return b, tier_b, prompt, blocker


def test_fetched_blocks_that_find_no_room_wait_for_it_with_their_request(model):
    """The 48 fetched tokens find no HOT room: kept (``install_retries``), the request keeps
    waiting for them, and once the running request gives its room back they are installed on
    the next look, without a second fetch. Dropping them made the request compute all 48
    (the demo's round-robin turns beside running requests: 88.5% of their session found)."""
    b, tier_b, prompt, blocker = fetched_without_room(model)
    assert b.cache.apply_l3() == 0 and tier_b.stats.install_retries == 1 and tier_b.stats.install_failures == 0
    again = b.cache.ready(prompt + [1], None)
    assert again.ready is False and again.tiers[-1] == 48 and tier_b.stats.fetches == 1   # waits for them
    blocker.release()
    assert b.cache.ready(prompt + [1], None).ready is True
    assert tier_b.stats.installed_tokens == 48 and tier_b.stats.fetches == 1 and tier_b.stats.install_failures == 0
    assert b.cache.lookup(prompt + [1]).length == 48


def test_fetched_blocks_that_wait_too_long_for_room_are_counted_and_the_request_computes(model, monkeypatch):
    """Past ``INSTALL_RETRY_S`` (0 here: at once) the fetched blocks go, counted, and the
    request computes without a second fetch."""
    import cluster.cache.l3.link as link

    monkeypatch.setattr(link, "INSTALL_RETRY_S", 0.0)
    b, tier_b, prompt, blocker = fetched_without_room(model)
    assert b.cache.apply_l3() == 0 and tier_b.stats.install_failures == 1 and tier_b.stats.install_retries == 0
    blocker.release()
    assert b.cache.ready(prompt + [1], None)[0] is True    # no second fetch: it computes
    assert tier_b.stats.fetches == 1 and tier_b.stats.installed_tokens == 0


def test_a_full_write_queue_drops_writes_and_counts_them(model):
    store = MemoryL3Store()
    a, tier_a, _ = make(model, store, max_pending_bytes=4096)   # less than one block of this model's KV
    run(a, tier_a, toks(600, 40), max_tokens=1)
    assert tier_a.stats.writes_dropped == 5 + 1 and store.num_values == 0   # 41 tokens: 5 blocks and 1
    assert len(tier_a.written) == 0 and len(tier_a.written_tails) == 0     # nothing is believed written


def test_a_flush_drops_the_writes_still_queued(model):
    """An admin flush removes this model's blocks from L3; writes queued before it
    must not store them again afterwards (the demo's next arm found them there)."""
    store = MemoryL3Store()
    a, tier_a, heard = make(model, store)
    req = a.submit(EngineRequest(toks(700, 40), SamplingParams(max_tokens=1)))
    while not req.finished:
        tier_a.run_pending()   # the fetch ahead (a miss)
        a.step()               # the last step commits: the write is queued
    a.complete_finished()
    assert tier_a.pending() == 1 and store.num_values == 0   # 5 blocks and 1 token queued, not stored yet
    a.cache.drop_all()
    assert tier_a.drop_queued_writes() == 6
    assert tier_a.run_pending() == 0 and store.num_values == 0 and tier_a.pending() == 0
    a.cache.apply_l3()
    assert tier_a.stats.writes_dropped == 6 and tier_a.stats.blocks_written == 0 and heard.stored == []
    assert len(tier_a.written) == 0 and len(tier_a.written_tails) == 0   # nothing is believed written


def test_hand_off_writes_what_l3_lacks_most_valuable_first(model):
    store = MemoryL3Store()
    a, tier_a, _ = make(model, store, warm=64, write="off")
    cold_prompt, hot_prompt = toks(700, 40), toks(800, 64)
    run(a, tier_a, cold_prompt, max_tokens=1)
    for _ in range(3):
        run(a, tier_a, hot_prompt + [1], max_tokens=1)
    assert store.num_values == 0                      # write="off": nothing written behind
    a.cache.demote_path(cold_prompt, tier=1)          # WARM blocks are handed off too
    order = a.cache.l3.valuable_prefixes()
    assert [len(p.tokens) for p in order][:2] == [66, 41] and order[0].hits >= 3
    tier_a.config = L3TierConfig(model_id="test-model")   # writes back on, for the hand-off
    done = a.cache.l3.queue_hand_off(deadline=time.monotonic() + 5.0)
    assert tier_a.flush(1.0) and a.cache.apply_l3() == 0
    assert done == {"prefixes": 2, "blocks": 5 + 8 + 2, "of_prefixes": 2}   # and the partial last blocks
    assert store.num_values == 15 and tier_a.stats.blocks_written == 13 and tier_a.stats.tails_written == 2


def test_shared_prefixes_are_the_branch_points_most_used_first(model):
    a, tier_a, _ = make(model, MemoryL3Store(), write="off")
    system, other = toks(1000, 24), toks(1001, 16)
    for i in range(3):
        run(a, tier_a, system + toks(1100 + i, 9), max_tokens=1)
    for i in range(2):
        run(a, tier_a, other + toks(1200 + i, 9), max_tokens=1)
    found = shared_prefixes(a.cache.tree)
    assert [p.tokens for p in found] == [tuple(system), tuple(other)]
    assert found[0].hits >= 2 and found[1].namespace is None


def test_prefix_value_weighs_reuse_recency_and_length():
    assert prefix_value(1000, 4, 0) > prefix_value(1000, 0, 0)
    assert prefix_value(1000, 4, 0) > prefix_value(1000, 4, 1200)
    assert prefix_value(2000, 0, 0) > 2 * prefix_value(1000, 0, 0)   # attention: more than linear


def test_a_fetch_does_not_wait_behind_a_write_and_writes_run_at_low_priority(model):
    """Writes and fetches have a thread each: a write stuck in the store holds up no fetch
    (a request may be waiting for that one), and the write thread runs at ``write_nice``."""
    import os
    import threading

    class SlowPuts(MemoryL3Store):
        def __init__(self):
            super().__init__()
            self.release, self.writer_nice = threading.Event(), None

        def put_blocks(self, blocks):
            self.writer_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            assert self.release.wait(30)
            return super().put_blocks(blocks)

    store = SlowPuts()
    c = model.config
    layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim)
    tier = L3Tier(store, layout, BT, L3TierConfig(model_id="test-model", write_nice=7))
    try:
        tokens = toks(900, 24)
        hashes = block_hashes(tokens, BT, salt=None)
        kv = torch.zeros(c.num_layers, 2, len(tokens), c.num_kv_heads, c.head_dim)
        assert tier.write(tokens, hashes, [0, 1, 2], kv) == 3
        tier.start_fetch(None, tokens, hashes, 0)
        assert tier.wait_fetches(10)                 # answered (misses) while the write is stuck
        assert [r.blocks for r in tier.take_fetched()] == [0] and tier.pending() == 1
        store.release.set()
        assert tier.flush(10) and tier.pending() == 0
        process_nice = os.getpriority(os.PRIO_PROCESS, 0)
        assert store.writer_nice == max(7, process_nice)
    finally:
        store.release.set()
        tier.close()


def test_config_is_validated():
    with pytest.raises(InvalidInputError, match="write_nice"):
        L3TierConfig(model_id="m", write_nice=20)
    with pytest.raises(InvalidInputError, match="write policy"):
        L3TierConfig(model_id="m", write="sometimes")
    with pytest.raises(InvalidInputError, match="min_fetch_blocks"):
        L3TierConfig(model_id="m", min_fetch_blocks=0)


def test_a_turns_own_tail_back_from_l3_sets_no_fetch_rate(model):
    store = MemoryL3Store()
    a, tier_a, _ = make(model, store)
    first = run(a, tier_a, toks(700, 40))   # 40 + 3 output tokens cached: five blocks and a 3-token tail in L3
    assert tier_a.stats.tails_written == 1 and tier_a.fetch_tokens_per_s is None
    # The next turn runs two blocks past what the cache holds: L3 has none of them, but the
    # fetch brings the 3-token tail the cache already holds: no measure of L3's rate.
    follow = run(a, tier_a, toks(700, 40) + first.output + toks(701, 20))
    assert follow.cached_tokens == 43 and tier_a.stats.fetches == 2 and tier_a.stats.tails_fetched == 1
    assert tier_a.stats.fetch_blocks_hit == 0 and tier_a.fetch_tokens_per_s is None


def test_a_guard_that_judged_l3_slower_probes_it_again_and_fetches_once_it_knows(model):
    """The rates say L3 is slower (1,000 against 50,000 tokens/s): no fetch, and no new
    sample to say otherwise. One fetch every ``probe_s`` goes ahead anyway; the one that
    came back fast enough (here: on the in-process store, faster than any prefill the fit is
    given) is a sample, and with enough of them the fit, not the rate, decides."""
    now = [0.0]
    store = MemoryL3Store()
    a, tier_a, _ = make(model, store)
    for seed in range(4):
        run(a, tier_a, toks(400 + seed, 40), max_tokens=1)
    b, tier_b, _ = make(model, store)
    tier_b.clock = lambda: now[0]
    tier_b.cost.last_probe = 0.0
    tier_b.set_rates(fetch_tokens_per_s=1_000.0, prefill_tokens_per_s=50_000.0)
    assert run(b, tier_b, toks(400, 40) + [5]).cached_tokens == 0
    assert tier_b.stats.fetch_skipped_slower >= 1 and tier_b.stats.fetches == 0
    now[0] = tier_b.cost.probe_s
    assert run(b, tier_b, toks(401, 40) + [5]).cached_tokens == 40
    assert tier_b.stats.fetch_probes == 1 and len(tier_b.cost.samples) == 1
    now[0] += 1.0   # within probe_s of the probe: the given rate still decides
    assert run(b, tier_b, toks(402, 40) + [5]).cached_tokens == 0
    assert tier_b.stats.fetch_probes == 1
