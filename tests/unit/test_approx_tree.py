"""``approx_tree``: SGLang's ``cache_aware`` router, ported, with the current
router crate's defaults and rules, and the legacy release's behind
``defaults="legacy"`` / ``replay --approx-tree-defaults legacy``.

Every expected value below is worked out by hand from the rules the module
doc names (the upstream files are cited next to ``APPROX_TREE_DEFAULTS``)."""

import json

import pytest

from cluster.cli import main
from cluster.errors import InvalidInputError
from cluster.routing.index import GlobalIndex
from cluster.routing.policies import make_policy
from cluster.routing.policies.baselines import APPROX_TREE_DEFAULTS, ApproxPrefixTree, LeafStampTree
from tests.unit.test_routing_policy import CHAIN, COST, Clock, running


def test_defaults_are_the_current_router_crates_and_legacy_stays_selectable():
    current = make_policy("approx_tree")
    assert (current.defaults, current.cache_threshold, current.balance_abs_threshold,
            current.balance_rel_threshold, current.eviction_interval_s, current.max_tree_size,
            current.low_match) == ("current", 0.3, 64, 1.5, 120.0, 2 ** 26, "least_loaded")
    assert isinstance(current.tree, LeafStampTree) and "01f6c92a" in current.source
    legacy = make_policy("approx_tree", defaults="legacy")
    assert (legacy.defaults, legacy.cache_threshold, legacy.balance_abs_threshold,
            legacy.balance_rel_threshold, legacy.eviction_interval_s, legacy.max_tree_size,
            legacy.low_match) == ("legacy", 0.5, 32, 1.0001, 60.0, 2 ** 24, "smallest_tree")
    assert isinstance(legacy.tree, ApproxPrefixTree)
    one_changed = make_policy("approx_tree", defaults="legacy", cache_threshold=0.3)   # the rest stay legacy
    assert (one_changed.cache_threshold, one_changed.balance_abs_threshold, one_changed.low_match) == \
        (0.3, 32, "smallest_tree")
    with pytest.raises(InvalidInputError, match="current, legacy"):
        make_policy("approx_tree", defaults="sgl-router-0.2")


def test_current_rules_low_match_goes_to_the_least_loaded_and_thresholds_are_strict():
    policy = make_policy("approx_tree", cost=COST, balance_abs_threshold=2)   # current otherwise: 0.3, x1.5
    ix = GlobalIndex()
    d = policy.choose(CHAIN, 600, running(a=1, b=0, c=0), ix)        # empty tree: least loaded, not a smallest tree
    assert (d.worker_id, d.reason, d.cached_tokens) == ("b", "load", 0)
    d = policy.choose(CHAIN, 600, running(a=6, b=9, c=6), ix)        # 9 - 6 > 2 but 9 > 1.5 x 6 is false: balanced
    assert (d.worker_id, d.reason, d.cached_tokens) == ("b", "prefix", 600)
    d = policy.choose([11, 12, 90, 91], 400, running(a=0, b=2, c=0), ix)   # 2/4 matched > 0.3
    assert (d.worker_id, d.reason, d.cached_tokens) == ("b", "prefix", 200)
    d = policy.choose([11, 50, 51, 52], 400, running(a=1, b=2, c=0), ix)   # 1/4 <= 0.3: least loaded c
    assert (d.worker_id, d.reason, d.cached_tokens) == ("c", "load", 0)  # (the legacy rule: a, the smallest tree)
    d = policy.choose(CHAIN, 600, running(a=3, b=0, c=1), ix)        # 3 - 0 > 2 and 3 > 1.5 x 0: least loaded
    assert (d.worker_id, d.reason) == ("b", "balance")
    assert policy.tree.deepest(CHAIN) == (6, ["b"]) and policy.tree.deepest([11]) == (1, ["b", "c"])
    assert (policy.tree_size("a"), policy.tree_size("b"), policy.tree_size("c")) == (0, 8, 4)
    # One epoch per match and per insert; the imbalanced request drew no match: 4 x 2 + 1.
    assert policy.tree.epoch == 9
    policy.tree.check_invariants()


def test_legacy_rules_smallest_tree_and_a_match_refreshes_the_path_of_a_worker_not_chosen():
    policy = make_policy("approx_tree", cost=COST, defaults="legacy", balance_abs_threshold=2)
    ix = GlobalIndex()
    d = policy.choose([1, 2], 200, running(a=0, b=0), ix)             # empty tree: smallest tree, a first
    assert (d.worker_id, d.reason) == ("a", "capacity")
    d = policy.choose([3], 100, running(a=0, b=5), ix)                # 5 - 0 > 2 and 5 > 1.0001 x 0
    assert (d.worker_id, d.reason) == ("a", "balance")
    assert list(policy.tree._lru["a"]) == [2, 1, 3]                   # oldest first
    d = policy.choose([1, 7, 8, 9], 400, running(a=0, b=0), ix)       # 1/4 <= 0.5: smallest tree b...
    assert (d.worker_id, d.reason) == ("b", "capacity")
    assert list(policy.tree._lru["a"]) == [2, 3, 1]                   # ...and a's matched path was refreshed


def test_leaf_stamp_tree_stamps_where_the_insert_ends_and_one_match_in_eight():
    tree = LeafStampTree()
    tree.insert("a", [1, 2, 3])          # epoch 0: a new node, stamped 0
    tree.insert("a", [4])                # epoch 1
    tree.insert("b", [1, 2, 5])          # epoch 2: joins a's 1 and 2 (stamp 0), its new 5 is stamped 2
    assert [tree.stamp("b", h) for h in (1, 2, 5)] == [0, 0, 2]
    tree.insert("a", [1, 2])             # epoch 3: only the block the insert ends at
    assert [tree.stamp("a", h) for h in (1, 2, 3, 4)] == [0, 3, 0, 1]
    for _ in range(4):                   # epochs 4-7: matched, not stamped
        assert tree.match([1, 2, 3, 9]) == (3, ["a"])
    assert tree.stamp("a", 3) == 0
    assert tree.match([1, 2, 3, 9]) == (3, ["a"])                     # epoch 8: stamps a's deepest matched block
    assert [tree.stamp("a", h) for h in (1, 2, 3)] == [0, 3, 8] and tree.stamp("b", 2) == 0
    tree.check_invariants()


def test_leaf_stamp_tree_evicts_oldest_leaves_and_a_stale_parent_before_a_fresher_leaf():
    tree = LeafStampTree()
    tree.insert("a", [1, 2, 3])          # epoch 0
    tree.insert("a", [1, 2, 3])          # epoch 1: 3 is stamped 1, its parents keep 0
    tree.insert("a", [4])                # epoch 2
    tree.insert("b", [1, 2])             # epoch 3: b joins with stamps 0, then 2 is stamped 3
    tree.evict(2)                        # a: leaf 3 (1), then its parent 2 (0) before leaf 4 (2); b is within 2
    assert (tree.matched("a", [1, 2, 3]), tree.matched("a", [4]), tree.size("a"), tree.size("b")) == (1, 1, 2, 2)
    tree.check_invariants()
    tree.evict(1)                        # a: 1 (0) before 4 (2); b: its leaf 2
    assert tree.deepest([1, 2]) == (1, ["b"]) and tree.deepest([4]) == (1, ["a"])
    tree.check_invariants()
    tree.remove_tenant("a")
    assert tree.deepest([4]) == (0, []) and tree.size("a") == 0 and tree.size("b") == 1
    tree.check_invariants()


def test_a_match_does_not_refresh_what_the_legacy_tree_kept():
    # Same inserts and one match, then evict to one block: the current tree keeps the
    # block inserted last (the match drew epoch 2, not a multiple of 8, and stamps
    # nothing); the legacy tree keeps the root of the matched path.
    current, legacy = LeafStampTree(), ApproxPrefixTree()
    current.insert("a", [1, 2])
    legacy.insert("a", [1, 2])
    current.insert("a", [3])
    legacy.insert("a", [3])
    assert current.match([1, 2]) == (2, ["a"])
    legacy.touch("a", [1, 2])
    current.evict(1)
    legacy.evict(1)
    assert (current.matched("a", [3]), current.matched("a", [1])) == (1, 0)
    assert (legacy.matched("a", [3]), legacy.matched("a", [1])) == (0, 1)


def test_current_policy_evicts_every_interval():
    clock = Clock()
    policy = make_policy("approx_tree", cost=COST, max_tree_size=300, eviction_interval_s=10, clock=clock)
    ix = GlobalIndex()
    policy.choose(CHAIN, 600, running(a=0), ix)
    assert policy.tree_size("a") == 6                 # evicted only at the next interval
    clock.t = 10.0
    policy.choose([77], 100, running(a=0), ix)        # evicts down to 3 blocks first, the chain's tail first
    assert policy.tree.matched("a", CHAIN) == 3 and policy.tree_size("a") == 4
    policy.tree.check_invariants()


@pytest.mark.parametrize("defaults, low_match_reason", [("current", "load"), ("legacy", "capacity")])
def test_replay_flag_selects_the_release_and_its_lines_name_it(capsys, defaults, low_match_reason):
    assert main(["replay", "--records", "300", "--replicas", "4", "--hot-blocks", "48", "--warm-blocks", "96",
                 "--policy", "approx_tree", "--approx-tree-defaults", defaults]) == 0
    line = next(json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{"))
    assert line["policy"] == "approx_tree" and line["approx_tree_defaults"] == defaults
    assert line["approx_tree_source"] == APPROX_TREE_DEFAULTS[defaults].source
    reasons = set(line["reasons"])
    assert low_match_reason in reasons and not reasons & ({"load", "capacity"} - {low_match_reason})
    assert make_policy("approx_tree").defaults == "current"
