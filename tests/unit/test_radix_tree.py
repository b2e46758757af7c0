import pytest

from cluster.cache.allocator import AllocatorConfig, BlockAllocator, Extent
from cluster.cache.radix_tree import RadixTree
from cluster.errors import InvalidInputError
from tests.unit.helpers import TickClock




def make_tree(num_blocks=64, block_tokens=4, policy="lru", vocab_size=None):
    alloc = BlockAllocator(AllocatorConfig(num_blocks=num_blocks, block_tokens=block_tokens))
    return RadixTree(alloc, policy=policy, clock=TickClock(), vocab_size=vocab_size), alloc


def put(tree, alloc, tokens, namespace=None):
    """Insert like a server: match, allocate the rest, insert from the match."""
    m = tree.match_prefix(tokens, namespace)
    if m.length == len(tokens):
        return m.last_node
    ext = alloc.allocate(len(tokens) - m.length)
    return tree.insert(tokens, ext, namespace, start=m.length).node


def test_match_returns_longest_prefix_and_its_extents():
    tree, alloc = make_tree()
    put(tree, alloc, [1, 2, 3, 4, 5, 6])
    m = tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert m.length == 6
    assert m.extents == [Extent(0, 0, 4), Extent(1, 0, 2)]
    assert tree.match_prefix([9]).length == 0
    tree.check_invariants()


def test_match_inside_a_node_splits_it_without_copy():
    tree, alloc = make_tree()
    leaf = put(tree, alloc, [1, 2, 3, 4, 5, 6])
    tree.lock(leaf)
    m = tree.match_prefix([1, 2, 3, 9])
    assert m.length == 3 and m.extents == [Extent(0, 0, 3)]
    head = m.last_node
    assert head.key.tolist() == [1, 2, 3] and leaf.key.tolist() == [4, 5, 6] and leaf.parent is head
    # The head inherits the lock count; the split extent stays on block 0.
    assert head.lock_ref == 1
    assert leaf.extents == [Extent(0, 3, 1), Extent(1, 0, 2)]
    assert alloc.refcount[0] == 2 and tree.stats["splits"] == 1
    tree.check_invariants()


def test_insert_reports_what_was_present_and_frees_duplicates():
    tree, alloc = make_tree()
    put(tree, alloc, [1, 2, 3, 4])
    ext = alloc.allocate(6)
    res = tree.insert([1, 2, 3, 4, 5, 6], ext)
    assert res.existing_length == 4 and res.freed_duplicate_tokens == 4
    assert tree.total_tokens == 6 and alloc.used_tokens == 6
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).length == 6
    tree.check_invariants()


def test_insert_validates_extents_and_start():
    tree, alloc = make_tree()
    ext = alloc.allocate(3)
    with pytest.raises(InvalidInputError, match="extents cover 3 tokens"):
        tree.insert([1, 2], ext)
    with pytest.raises(InvalidInputError, match=r"tokens\[:2\] must be cached"):
        tree.insert([1, 2, 3, 4, 5], ext, start=2)
    tree.insert([1, 2, 3], ext)
    with pytest.raises(InvalidInputError, match="already owned"):
        tree.insert([7, 8, 9], ext)
    tree.check_invariants()
    assert alloc.used_tokens == 3


@pytest.mark.parametrize("bad, message", [
    ([], "must not be empty"),
    ([1, -2], "must be >= 0"),
    ([1, 2.5], "integer ids"),
    (["a"], "integer ids"),
    ("abc", "sequence of integer ids"),
    ([1, 300], "vocab_size=256"),
])
def test_bad_tokens_raise_and_leave_the_tree_intact(bad, message):
    tree, alloc = make_tree(vocab_size=256)
    put(tree, alloc, [1, 2, 3])
    with pytest.raises(InvalidInputError, match=message):
        tree.match_prefix(bad)
    tree.check_invariants()
    assert tree.match_prefix([1, 2, 3]).length == 3


def test_lock_moves_tokens_between_evictable_and_protected():
    tree, alloc = make_tree()
    leaf = put(tree, alloc, [1, 2, 3, 4, 5])
    other = put(tree, alloc, [1, 2, 9])
    assert (tree.evictable_tokens, tree.protected_tokens) == (6, 0)
    tree.lock(leaf)
    assert (tree.evictable_tokens, tree.protected_tokens) == (1, 5)
    tree.lock(other)
    assert (tree.evictable_tokens, tree.protected_tokens) == (0, 6)
    tree.unlock(leaf)
    tree.unlock(other)
    assert (tree.evictable_tokens, tree.protected_tokens) == (6, 0)
    with pytest.raises(InvalidInputError, match="not locked"):
        tree.unlock(leaf)
    tree.check_invariants()


def test_eviction_order_is_exact_lru_and_skips_locked():
    tree, alloc = make_tree()
    a = put(tree, alloc, [1, 1, 1])
    b = put(tree, alloc, [2, 2, 2])
    c = put(tree, alloc, [3, 3, 3])
    tree.match_prefix([1, 1, 1])          # a is now the most recent
    tree.lock(b)
    assert tree.evict(3) == 3
    assert [n.alive for n in (a, b, c)] == [True, True, False]
    assert tree.evict(100) == 3
    assert [n.alive for n in (a, b, c)] == [False, True, False]
    tree.unlock(b)
    assert tree.evict(1) == 3 and not b.alive
    tree.check_invariants()
    assert alloc.used_tokens == 0


def test_lfu_policy_evicts_least_hit_first():
    tree, alloc = make_tree(policy="lfu")
    a = put(tree, alloc, [1, 1])
    b = put(tree, alloc, [2, 2])
    for _ in range(3):
        tree.match_prefix([1, 1])
    tree.match_prefix([2, 2])   # b is more recent but less frequent
    assert tree.evict(2) == 2
    assert a.alive and not b.alive


def test_parent_becomes_a_leaf_then_evictable():
    tree, alloc = make_tree()
    put(tree, alloc, [1, 2, 3, 4])
    put(tree, alloc, [1, 2, 5, 6])
    put(tree, alloc, [1, 2, 7, 8])
    assert tree.evict(100) == 8
    assert not tree.root().children
    tree.check_invariants()


def test_eviction_merges_single_child_chains():
    tree, alloc = make_tree()
    put(tree, alloc, [1, 2, 3, 4, 5, 6, 7, 8])
    put(tree, alloc, [1, 2, 3, 4, 9])     # splits after 4: node [1..4] with children [5..8], [9]
    tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])  # [9] is now the LRU leaf
    assert tree.evict(1) == 1
    (only,) = tree.root().children.values()
    assert only.key.tolist() == [1, 2, 3, 4, 5, 6, 7, 8] and not only.children
    # The two extents on block 0 were joined back into one.
    assert only.extents == [Extent(0, 0, 4), Extent(1, 0, 4)]
    assert tree.stats["merges"] == 1
    tree.check_invariants()


def test_no_merge_when_a_node_is_locked():
    tree, alloc = make_tree()
    put(tree, alloc, [1, 2, 3, 4, 5, 6])
    put(tree, alloc, [1, 2, 3, 9])
    head = tree.match_prefix([1, 2, 3]).last_node
    locked = tree.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    tree.lock(locked)
    assert tree.evict(1) == 1
    assert head.alive and locked.parent is head
    tree.check_invariants()


def test_namespaces_never_share_prefixes():
    tree, alloc = make_tree()
    put(tree, alloc, [1, 2, 3], namespace="tenant-a")
    assert tree.match_prefix([1, 2, 3], namespace="tenant-b").length == 0
    assert tree.match_prefix([1, 2, 3]).length == 0
    assert tree.match_prefix([1, 2, 3], namespace="tenant-a").length == 3
    with pytest.raises(InvalidInputError, match="namespace"):
        tree.match_prefix([1], namespace=("a", "b"))
    tree.check_invariants()


def test_evict_rejects_bad_counts():
    tree, _ = make_tree()
    with pytest.raises(InvalidInputError, match="num_tokens"):
        tree.evict(-1)


def test_peek_finds_what_match_finds_and_changes_nothing():
    """``peek`` (the scheduler's look at waiting requests) gives the cached length by
    tier that ``match_prefix`` gives, ending inside an edge too, without splitting the
    edge or touching any node's recency."""
    import random

    rng = random.Random(3)
    tree, alloc = make_tree(num_blocks=256)
    for _ in range(12):
        put(tree, alloc, [rng.randrange(4) for _ in range(rng.randrange(1, 12))])
    for _ in range(200):
        query = [rng.randrange(4) for _ in range(rng.randrange(1, 14))]
        before = [(n.last_access, len(n.key), len(n.children)) for n in tree.iter_nodes()]
        hot, tiers = tree.peek(query)
        assert [(n.last_access, len(n.key), len(n.children)) for n in tree.iter_nodes()] == before
        m = tree.match_prefix(query)
        assert hot and tiers == list(m.tier_lengths) and sum(tiers) == m.length
