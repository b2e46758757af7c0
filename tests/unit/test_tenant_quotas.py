"""Per-tenant quotas (``cluster.cache.quotas``): who is evicted for whom, exactly; caps; config checks; counters.

HOT and WARM hold 32 tokens each (8 blocks of 4); every sequence is 8 tokens
(two whole blocks) of one repeated token, so each is one node and the tiers'
contents can be named exactly. Watermarks are off (high 1.0): only room-making
moves anything, unless a test turns them on.
"""

import pytest

from cluster.cache.quota_config import QuotaConfig
from cluster.cache.quotas import NOBODY, TenantQuotas
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.errors import InvalidInputError, PoolExhaustedError
from cluster.names import COLD, HOT, WARM
from tests.unit.helpers import TickClock

TIERS = ("hot", "warm", "cold")


def make(quotas=None, hot=8, warm=8, cold=0, **kw):
    kw.setdefault("high_watermark", 1.0)
    kw.setdefault("low_watermark", 0.5)
    cfg = TierConfig(hot_blocks=hot, warm_blocks=warm, cold_blocks=cold, block_tokens=4, device="cpu",
                     tenant_quotas=quotas, **kw)
    return TieredCache(cfg, None, clock=TickClock())


def seq(i):
    return [i] * 8


def put(cache, i, ns):
    """Cache sequence ``i`` of tenant ``ns`` as a request does (lease, room, commit)."""
    lease = cache.admit(seq(i), ns, compute_last=False)
    try:
        lease.extend(8 - lease.cached_tokens)
        lease.commit(seq(i))
    finally:
        lease.release()


def where(cache, i, ns):
    """The tier sequence ``i`` of ``ns`` is in (None: not cached), without touching it."""
    tiers = cache.tree.peek(seq(i), ns)[1]
    return next((TIERS[t] for t in range(3) if tiers[t] == 8), None) if sum(tiers) else None


def where_tokens(cache, tokens, ns):
    """The tier all of ``tokens`` of ``ns`` is in (None: not all cached in one tier)."""
    tiers = cache.tree.peek(tokens, ns)[1]
    return next((TIERS[t] for t in range(3) if tiers[t] == len(tokens)), None)


def layout(cache, items):
    return {(ns, i): where(cache, i, ns) for ns, i in items}


B_HALF = {"tenants": {"B": {"hot": {"guarantee": 0.5}, "warm": {"guarantee": 0.5}}}}


# --------------------------------------------------------------------- the rules
def test_without_quotas_a_flood_pushes_the_other_tenant_out():
    cache = make()
    put(cache, 1, "B"), put(cache, 2, "B"), put(cache, 10, "A"), put(cache, 11, "A")
    put(cache, 12, "A")
    assert where(cache, 1, "B") == "warm"   # plain LRU: B's oldest went for A
    assert cache.tenant_stats() == {}


def test_a_tenant_at_its_guarantee_is_never_pushed_out_for_another():
    cache = make(B_HALF)
    put(cache, 1, "B"), put(cache, 2, "B"), put(cache, 10, "A"), put(cache, 11, "A")
    for i in range(12, 18):   # A floods: only A's own data makes room, oldest first
        put(cache, i, "A")
    got = layout(cache, [("B", 1), ("B", 2)] + [("A", i) for i in range(10, 18)])
    assert got == {("B", 1): "hot", ("B", 2): "hot",
                   ("A", 10): None, ("A", 11): None, ("A", 12): "warm", ("A", 13): "warm",
                   ("A", 14): "warm", ("A", 15): "warm", ("A", 16): "hot", ("A", 17): "hot"}
    stats = cache.tenant_stats()
    assert stats["B"]["evictions_suffered"] == {"hot": 0, "warm": 0, "cold": 0, "l3": 0}
    assert stats["A"]["evictions_caused"]["hot"] == 6 * 8   # each flood request pushed one of its own down
    assert stats["A"]["evictions_suffered_from_others"]["hot"] == 0
    assert stats["B"]["resident_tokens"] == {"hot": 16, "warm": 0, "cold": 0}
    assert stats["A"]["resident_tokens"] == {"hot": 16, "warm": 32, "cold": 0}
    cache.check_invariants()


def test_tenants_over_their_guarantee_give_first_in_lru_order_across_them():
    cache = make(B_HALF)
    put(cache, 1, "B"), put(cache, 2, "B"), put(cache, 3, "B")   # B: 24 > its 16
    put(cache, 10, "A")                                           # HOT full
    put(cache, 11, "A")   # over guarantee: B (24 > 16) and A (8 > 0); B's 1 is the least recent
    assert layout(cache, [("B", 1), ("B", 2), ("B", 3), ("A", 10), ("A", 11)]) == {
        ("B", 1): "warm", ("B", 2): "hot", ("B", 3): "hot", ("A", 10): "hot", ("A", 11): "hot"}
    put(cache, 12, "A")   # B is at its guarantee now: A's own 10 goes, although B's 2 is older
    assert layout(cache, [("B", 2), ("A", 10)]) == {("B", 2): "hot", ("A", 10): "warm"}
    stats = cache.tenant_stats()
    assert stats["B"]["evictions_suffered_from_others"]["hot"] == 8
    assert stats["A"]["evictions_caused"]["hot"] == 16


def test_the_tenant_furthest_over_its_guarantee_gives_first_whatever_the_lru_order():
    """HOT 48 tokens, B guaranteed 24: B holds 32 (8 over), A 16 (16 over, its guarantee 0).
    B's oldest sequence is the least recently used of all, but A is further over: A's own
    oldest goes for A's next request, and for B's. Under plain LRU across the givers B's
    1 would go both times."""
    cache = make(B_HALF, hot=12)
    for i in (1, 2, 3, 4):
        put(cache, i, "B")
    put(cache, 10, "A"), put(cache, 11, "A")   # HOT full
    q = cache.quotas
    assert (q.excess("B", HOT), q.excess("A", HOT)) == (8, 16)
    put(cache, 12, "A")
    assert layout(cache, [("B", 1), ("A", 10), ("A", 11), ("A", 12)]) == {
        ("B", 1): "hot", ("A", 10): "warm", ("A", 11): "hot", ("A", 12): "hot"}
    put(cache, 5, "B")   # B over by 8 (16 with this one), A by 16: still A's
    assert layout(cache, [("B", 1), ("A", 11)]) == {("B", 1): "hot", ("A", 11): "warm"}
    assert (q.excess("B", HOT), q.excess("A", HOT)) == (16, 8)
    put(cache, 13, "A")   # now B is the furthest over: B's oldest goes
    assert layout(cache, [("B", 1), ("B", 2), ("A", 12), ("A", 13)]) == {
        ("B", 1): "warm", ("B", 2): "hot", ("A", 12): "hot", ("A", 13): "hot"}
    assert cache.tenant_stats()["B"]["evictions_suffered_from_others"]["hot"] == 8
    cache.check_invariants()


def test_one_room_is_made_from_the_furthest_tenant_first_not_a_node_from_each_in_turn():
    """No guarantees: C holds 16 (the oldest), B 24, A 8; HOT (48) is full. D's 16 tokens,
    one room, come from B alone (24 over, the furthest), both of its older sequences: the
    order is taken once for the room. Taken again after B's first went, B and C would be
    equally far over (16) and C's older 4 would go second."""
    cache = make({"default": {"hot": {"cap": 1.0}}}, hot=12)
    put(cache, 4, "C"), put(cache, 5, "C")
    put(cache, 1, "B"), put(cache, 2, "B"), put(cache, 3, "B")
    put(cache, 10, "A")
    assert cache.hot.allocator.free_blocks == 0
    lease = cache.admit([7] * 16, "D", compute_last=False)
    try:
        lease.extend(16)
        lease.commit([7] * 16)
    finally:
        lease.release()
    assert layout(cache, [("B", 1), ("B", 2), ("B", 3), ("C", 4), ("C", 5), ("A", 10)]) == {
        ("B", 1): "warm", ("B", 2): "warm", ("B", 3): "hot", ("C", 4): "hot", ("C", 5): "hot", ("A", 10): "hot"}
    cache.check_invariants()


def test_a_tenant_under_its_guarantee_makes_room_from_its_own_data_last():
    cache = make(B_HALF)
    put(cache, 10, "A"), put(cache, 11, "A"), put(cache, 12, "A"), put(cache, 13, "A")   # A fills HOT
    put(cache, 1, "B")   # B (0 < 16) takes from A, over its guarantee of 0
    assert layout(cache, [("A", 10), ("B", 1)]) == {("A", 10): "warm", ("B", 1): "hot"}
    put(cache, 2, "B")
    assert where(cache, 11, "A") == "warm"
    put(cache, 3, "B")   # A (16) still over its 0, B (16) at its 16: A gives again
    assert where(cache, 12, "A") == "warm"
    put(cache, 4, "B")
    put(cache, 5, "B")   # A holds nothing in HOT any more: B's own oldest goes
    assert layout(cache, [("A", 13), ("B", 1), ("B", 5)]) == {("A", 13): "warm", ("B", 1): "warm",
                                                               ("B", 5): "hot"}


def test_a_tenant_at_its_cap_pushes_out_its_own_data_even_with_free_room():
    cache = make({"default": {"hot": {"cap": 0.5}}})
    put(cache, 10, "A"), put(cache, 11, "A")   # A: 16 = its cap (of 32)
    assert cache.hot.allocator.free_blocks == 4
    put(cache, 12, "A")
    assert layout(cache, [("A", 10), ("A", 11), ("A", 12)]) == {("A", 10): "warm", ("A", 11): "hot",
                                                                 ("A", 12): "hot"}
    assert cache.hot.allocator.free_blocks == 4
    put(cache, 1, "B")   # B (also capped at 16) is not touched by A's cap, nor A's data by B's room
    assert layout(cache, [("B", 1), ("A", 11), ("A", 12)]) == {("B", 1): "hot", ("A", 11): "hot",
                                                                ("A", 12): "hot"}
    assert cache.tenant_stats()["A"]["evictions_caused"]["hot"] == 8


def test_warm_keeps_the_guarantee_when_a_demotion_needs_room_and_the_last_tier_drops():
    cache = make({"tenants": {"B": {"warm": {"guarantee": 0.5}}}}, hot=4, warm=8)
    put(cache, 1, "B"), put(cache, 2, "B")   # B fills HOT (16)
    put(cache, 10, "A"), put(cache, 11, "A")   # B's 1 and 2 go down to WARM (B: 16 = its WARM guarantee)
    put(cache, 12, "A"), put(cache, 13, "A")   # A's 10, 11 down: WARM full
    assert layout(cache, [("B", 1), ("B", 2), ("A", 10), ("A", 11)]) == {
        ("B", 1): "warm", ("B", 2): "warm", ("A", 10): "warm", ("A", 11): "warm"}
    put(cache, 14, "A")   # A's 12 goes down; WARM's room for it: A's own 10 is dropped, not B's
    assert layout(cache, [("B", 1), ("B", 2), ("A", 10), ("A", 12)]) == {
        ("B", 1): "warm", ("B", 2): "warm", ("A", 10): None, ("A", 12): "warm"}
    stats = cache.tenant_stats()
    assert stats["A"]["evictions_suffered"]["warm"] == 8
    assert stats["B"]["evictions_suffered"]["warm"] == 0


def test_a_node_longer_than_its_tenants_warm_cap_moves_down_in_a_part_that_fits_it(tmp_path):
    """A's WARM cap is 8 tokens; its 16-token sequence must leave HOT: the leaf-ward 8 go down
    (cut on a block boundary), the head stays. It used to be dropped whole, cap or not."""
    cache = make({"default": {"warm": {"cap": 0.25}}}, hot=8, warm=8, cold=8, disk_dir=str(tmp_path))
    long = [5] * 16
    lease = cache.admit(long, "A", compute_last=False)
    lease.extend(16)
    lease.commit(long)
    lease.release()
    put(cache, 1, "A"), put(cache, 2, "A"), put(cache, 3, "A")   # 40 tokens of A for a HOT of 32
    cache.wait_all()
    cache.poll()
    assert cache.tree.peek(long, "A")[1][:3] == [8, 8, 0]
    assert [where(cache, i, "A") for i in (1, 2, 3)] == ["hot"] * 3
    assert (cache.stats["demotion_splits"], cache.stats["dropped_tokens"]) == (1, 0)


def test_nothing_evictable_under_the_rules_means_no_room():
    cache = make({"tenants": {"B": {"hot": {"guarantee": 0.5}}, "C": {"hot": {"guarantee": 0.5}}}})
    put(cache, 1, "B"), put(cache, 2, "B"), put(cache, 20, "C"), put(cache, 21, "C")
    lease = cache.admit(seq(30), "A", compute_last=False)   # A may take nobody's room
    with pytest.raises(PoolExhaustedError):
        lease.extend(8)
    lease.release()
    assert [where(cache, i, ns) for ns, i in (("B", 1), ("B", 2), ("C", 20), ("C", 21))] == ["hot"] * 4


def test_background_watermarks_only_push_down_tenants_over_their_guarantee():
    for quotas, expect in ((B_HALF, ["hot", "hot", "warm"]), (None, ["warm", "hot", "hot"])):
        cache = make(quotas, high_watermark=0.7, low_watermark=0.5)
        put(cache, 1, "B"), put(cache, 2, "B"), put(cache, 10, "A")   # 24 of 32: past 0.7
        cache.housekeeping()   # idle: down to 16 (0.5); without quotas B's 1, the least recent, goes
        assert [where(cache, i, ns) for ns, i in (("B", 1), ("B", 2), ("A", 10))] == expect


def test_preemption_follows_the_same_rule():
    cache = make(B_HALF)
    q = cache.quotas
    put(cache, 1, "B"), put(cache, 2, "B")
    assert cache.may_preempt("A", "A")
    assert not cache.may_preempt("A", "B")   # B at its guarantee
    running = cache.admit(seq(3), "B", compute_last=False)
    running.extend(4)                        # a running request's KV counts toward its tenant
    assert q.holds("B", HOT) == 20 and q.resident[HOT]["B"] == 16
    assert cache.may_preempt("A", "B")       # B over it
    running.extend(4)
    running.commit(seq(3))
    running.release()
    assert q.holds("B", HOT) == 24 and not q.running   # committed: in the tree, counted once
    assert cache.may_preempt("A", "B")
    assert make().may_preempt("A", "B")      # no quotas: anyone


def test_a_tenant_is_preempted_only_for_one_less_far_over_its_guarantee():
    """HOT 48 tokens; B, guaranteed 24, holds 32 (8 over); A, guaranteed nothing, runs 4
    tokens, then 8, then 12 (nothing is pushed out: 44 fit). At 4 over A may preempt B (B
    further over); equally far over, neither the other; at 12 over A may not (a flood over
    its guarantee never takes a quieter tenant's running turn), while B may preempt A. What
    the requester asks for counts toward how far over it would be."""
    cache = make(B_HALF, hot=12)
    q = cache.quotas
    for i in (1, 2, 3, 4):
        put(cache, i, "B")
    a = cache.admit([5] * 12, "A", compute_last=False)
    try:
        a.extend(4)
        assert (q.excess("B", HOT), q.excess("A", HOT)) == (8, 4)
        assert cache.may_preempt("A", "B") and not cache.may_preempt("B", "A")
        assert not cache.may_preempt("A", "B", 4)   # A asking 4 more would be as far over as B
        a.extend(4)
        assert (q.excess("B", HOT), q.excess("A", HOT)) == (8, 8)
        assert not cache.may_preempt("A", "B") and not cache.may_preempt("B", "A")
        a.extend(4)
        assert (q.excess("B", HOT), q.excess("A", HOT)) == (8, 12)
        assert not cache.may_preempt("A", "B") and cache.may_preempt("B", "A")
        assert cache.may_preempt("B", "A", 3) and not cache.may_preempt("B", "A", 4)
    finally:
        a.release()
    # A preempted (its KV gone) asks its 12 again: B, 8 over, is not further over than A would
    # be, so A cannot take the room straight back (the two would preempt each other in turn).
    assert q.excess("A", HOT) == 0
    assert not cache.may_preempt("A", "B", 12) and cache.may_preempt("A", "B", 7)


def test_hits_and_lookups_by_tenant():
    cache = make(B_HALF)
    put(cache, 1, "B")
    lease = cache.admit(seq(1) + [5, 5, 5, 5], "B")
    lease.release()
    row = cache.tenant_stats()["B"]
    assert row["lookups"] == 2 and row["hit_tokens"] == {"hot": 8, "warm": 0, "cold": 0, "l3": 0}


def test_acting_is_a_stack_and_nobody_takes_only_from_tenants_over_their_guarantee():
    cache = make(B_HALF)
    q = cache.quotas
    assert q.actor == (NOBODY, 0)
    with q.acting("A", 8):
        with q.acting("B", 4):
            assert q.actor == ("B", 4)
        assert q.actor == ("A", 8)
    assert q.allowed(HOT) == []   # background work, and nobody holds anything: nobody gives


# --------------------------------------------------------------------------- L3
def l3_quotas(config):
    cache = make()
    return TenantQuotas(cache.tree, QuotaConfig.parse(config))


def test_l3_cap_removes_the_tenants_own_oldest_blocks():
    q = l3_quotas({"l3_blocks": 10, "default": {"l3": {"cap": 0.3}}})
    assert q.l3_admit("A", [1, 2, 3]) == ([0, 1, 2], [])
    assert q.l3_admit("A", [3, 4, 5]) == ([1, 2], [1, 2])   # 3 is written already; 4 and 5 push out 1 and 2
    assert list(q.l3_written["A"]) == [3, 4, 5]
    assert q.tenant_stats()["A"]["evictions_suffered"]["l3"] == 2


def test_l3_budget_takes_from_tenants_over_their_guarantee_and_skips_what_fits_nowhere():
    q = l3_quotas({"l3_blocks": 4, "tenants": {"B": {"l3": {"guarantee": 0.5}}, "A": {"l3": {"guarantee": 0.5}}}})
    assert q.l3_admit("B", [1, 2]) == ([0, 1], [])
    assert q.l3_admit("A", [10, 11, 12]) == ([1, 2], [])   # past the budget: A's own oldest (10, never written)
    assert q.l3_admit("B", [3]) == ([0], [1])                    # nobody else over: B's own oldest
    assert q.l3_admit("C", [20]) == ([], [])                     # A and B at their guarantees: skipped
    assert q.l3_skipped_blocks == 1
    q.l3_forget([2])
    assert q.l3_admit("C", [20]) == ([0], [])
    stats = q.tenant_stats()
    assert (stats["B"]["l3_blocks"], stats["A"]["l3_blocks"], stats["C"]["l3_blocks"]) == (1, 2, 1)
    assert stats["B"]["evictions_suffered_from_others"]["l3"] == 0
    assert stats["A"]["evictions_caused"]["l3"] == 1


def test_l3_unlimited_without_l3_blocks():
    q = l3_quotas({})
    assert q.l3_admit("A", [1, 2]) == ([0, 1], [])


# ----------------------------------------------------------------------- config
@pytest.mark.parametrize("spec, message", [
    ({"default": {"hot": {"guarantee": 0.6, "cap": 0.5}}}, "guarantee 0.6 exceeds cap 0.5"),
    ({"tenants": {"A": {"hot": {"guarantee": 0.6}}, "B": {"hot": {"guarantee": 0.5}}}},
     "the hot guarantees add up to 1.1"),
    ({"default": {"hot": {"guarantee": 0.5}}, "tenants": {"A": {"hot": {"guarantee": 0.6}}}},
     "the hot guarantees add up to 1.1"),
    ({"default": {"hbm": {"cap": 0.5}}}, "unknown tiers ['hbm']"),
    ({"default": {"hot": {"share": 0.5}}}, "unknown keys ['share']"),
    ({"default": {"hot": {"cap": 0}}}, "cap must be > 0"),
    ({"default": {"hot": {"cap": 1.5}}}, "must be in [0, 1]"),
    ({"default": {"hot": {"cap": True}}}, "must be a number"),
    ({"default": {"hot": 0.5}}, "must be a mapping with 'guarantee'"),
    ({"default": {"l3": {"cap": 0.5}}}, "l3 shares need l3_blocks"),
    ({"l3_blocks": -1}, "l3_blocks must be a non-negative integer"),
    ({"tenant": {}}, "unknown keys ['tenant']"),
    ([], "tenant_quotas must be a mapping"),
])
def test_config_errors_name_the_problem(spec, message):
    with pytest.raises(InvalidInputError, match=message.replace("[", r"\[").replace("(", r"\(")):
        QuotaConfig.parse(spec)


def test_keys_resolve_to_their_tenants_and_never_echo_the_key():
    keys = {"sk-b": "team-b", "sk-b2": "team-b"}
    config = QuotaConfig.parse({"keys": {"sk-b": {"hot": {"guarantee": 0.5}}}}, keys)
    assert config.quota_of("team-b").shares[HOT].guarantee == 0.5
    assert config.quota_of("someone") == config.default
    with pytest.raises(InvalidInputError, match="not among the configured api_keys") as err:
        QuotaConfig.parse({"keys": {"sk-secret": {}}}, keys)
    assert "sk-secret" not in str(err.value)
    with pytest.raises(InvalidInputError, match="tenant 'team-b' already has a different quota"):
        QuotaConfig.parse({"keys": {"sk-b": {"hot": {"cap": 0.5}}, "sk-b2": {"hot": {"cap": 0.4}}}}, keys)


def test_tier_config_keeps_the_checked_plain_form():
    cfg = TierConfig(hot_blocks=8, tenant_quotas={"tenants": {"B": {"warm": {"guarantee": 0.25}}}})
    assert cfg.tenant_quotas == {"default": {}, "tenants": {"B": {"warm": {"guarantee": 0.25, "cap": 1.0}}},
                                 "l3_blocks": 0}
    assert QuotaConfig.parse(cfg.tenant_quotas).quota_of("B").shares[WARM].guarantee == 0.25
    with pytest.raises(InvalidInputError, match="guarantees add up"):
        TierConfig(hot_blocks=8, tenant_quotas={"default": {"cold": {"guarantee": 1}},
                                                "tenants": {"B": {"cold": {"guarantee": 0.1}}}})
    assert COLD == 2


def test_l3_a_write_past_the_cap_keeps_its_newest_blocks_only():
    q = l3_quotas({"l3_blocks": 10, "default": {"l3": {"cap": 0.2}}})
    assert q.l3_admit("A", [1, 2, 3]) == ([1, 2], [])   # block 1 would go at once: never written
    assert q.tenant_stats()["A"]["l3_blocks"] == 2


def test_l3_quota_through_the_cache_removes_the_blocks_from_the_store():
    import torch

    from cluster.cache.kv_pool import KVLayout
    from cluster.cache.l3.memory import MemoryL3Store
    from cluster.cache.l3.tier import L3Tier, L3TierConfig
    from cluster.hashing import block_hashes

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4)
    cfg = TierConfig(hot_blocks=32, block_tokens=4, device="cpu",
                     tenant_quotas={"l3_blocks": 8, "default": {"l3": {"cap": 0.25}}})
    cache = TieredCache(cfg, layout, clock=TickClock())
    store = MemoryL3Store()
    tier = L3Tier(store, layout, 4, L3TierConfig(model_id="m"), start_thread=False)
    cache.attach_l3(tier)
    heard = {"stored": [], "removed": []}   # what the directory hears (its L3 share counts)

    class Heard:
        def on_l3_stored(self, hashes, namespace=None):
            heard["stored"].append((namespace, list(hashes)))

        def on_l3_removed(self, hashes):
            heard["removed"].append(list(hashes))

    tier.listeners.append(Heard())

    def commit(tokens, ns):
        lease = cache.admit(tokens, ns, compute_last=False)
        lease.append(torch.ones(1, 2, len(tokens) - lease.cached_tokens, 1, 4))
        lease.commit(tokens)
        lease.release()
        tier.run_pending()
        cache.apply_l3()

    first, second = list(range(1, 9)), list(range(20, 28))   # two blocks each: A's cap is 2
    commit(first, "A")
    commit(second, "A")
    commit(first, "B")
    keys_a1 = [tier.key(h) for h in block_hashes(first, 4, salt="A")]
    keys_a2 = [tier.key(h) for h in block_hashes(second, 4, salt="A")]
    keys_b = [tier.key(h) for h in block_hashes(first, 4, salt="B")]
    assert store.contains(keys_a1) == (False, False)   # pushed out by A's second sequence
    assert store.contains(keys_a2) == (True, True)
    assert store.contains(keys_b) == (True, True)     # another tenant's blocks: untouched
    assert tier.stats.quota_removed == 2
    assert cache.tenant_stats()["A"]["evictions_suffered"]["l3"] == 2
    assert heard == {"stored": [("A", block_hashes(first, 4, salt="A")), ("A", block_hashes(second, 4, salt="A")),
                                ("B", block_hashes(first, 4, salt="B"))],
                     "removed": [block_hashes(first, 4, salt="A")]}



def test_l3_blocks_removed_for_a_quota_while_still_queued_are_never_written():
    """A's second sequence pushes its first out of its L3 share before the first was
    written (the commit's write goes first in the queue): the first is not written
    at all, so the store never holds more of A than its share."""
    import torch

    from cluster.cache.kv_pool import KVLayout
    from cluster.cache.l3.memory import MemoryL3Store
    from cluster.cache.l3.tier import L3Tier, L3TierConfig
    from cluster.hashing import block_hashes

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4)
    cache = TieredCache(TierConfig(hot_blocks=32, block_tokens=4, device="cpu",
                                   tenant_quotas={"l3_blocks": 8, "default": {"l3": {"cap": 0.25}}}),
                        layout, clock=TickClock())
    store = MemoryL3Store()
    tier = L3Tier(store, layout, 4, L3TierConfig(model_id="m"), start_thread=False)
    cache.attach_l3(tier)
    first, second = list(range(1, 9)), list(range(20, 28))
    for tokens in (first, second):   # both queued before the I/O runs
        lease = cache.admit(tokens, "A", compute_last=False)
        lease.append(torch.ones(1, 2, len(tokens), 1, 4))
        lease.commit(tokens)
        lease.release()
    tier.run_pending()
    cache.apply_l3()
    assert store.contains([tier.key(h) for h in block_hashes(first, 4, salt="A")]) == (False, False)
    assert store.contains([tier.key(h) for h in block_hashes(second, 4, salt="A")]) == (True, True)
    assert (tier.stats.writes_cancelled, tier.stats.write_failures, tier.stats.blocks_written) == (2, 0, 2)
    assert cache.tenant_stats()["A"]["l3_blocks"] == 2
