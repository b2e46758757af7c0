"""Node block hashes cached at insert, split and merge equal a fresh hash of the path."""

import random

import pytest

from cluster.cache.allocator import AllocatorConfig, BlockAllocator
from cluster.cache.radix_tree import RadixTree
from cluster.cache.token_key import decode_tokens, encode_tokens
from cluster.errors import InvalidInputError
from cluster.hashing import block_hashes, chain_hashes_u32, salt_seed
from tests.unit.helpers import TickClock

B = 4


def make_tree(hash_block_tokens=B, num_blocks=256):
    alloc = BlockAllocator(AllocatorConfig(num_blocks=num_blocks, block_tokens=B))
    return RadixTree(alloc, clock=TickClock(), hash_block_tokens=hash_block_tokens), alloc


def put(tree, alloc, tokens, namespace=None):
    m = tree.match_prefix(tokens, namespace)
    if m.length == len(tokens):
        return m.last_node
    return tree.insert(tokens, alloc.allocate(len(tokens) - m.length), namespace, start=m.length).node


def test_leaf_hashes_are_the_blocks_ending_in_it():
    tree, alloc = make_tree()
    a = put(tree, alloc, list(range(10)))             # blocks 0, 1 end in it
    b = put(tree, alloc, list(range(10)) + [50, 51])   # block 2 = tokens 8..11 ends in the new leaf
    full = block_hashes(list(range(10)) + [50, 51], B)
    assert a.hashes == full[:2] and b.hashes == full[2:]
    tree.check_invariants()


def test_split_cuts_the_hashes_on_the_block_boundary():
    tree, alloc = make_tree()
    leaf = put(tree, alloc, list(range(13)))           # blocks 0..2
    tree.lock(leaf)
    m = tree.match_prefix(list(range(6)) + [99])        # split after 6 tokens: block 0 ends in the head
    full = block_hashes(list(range(13)), B)
    assert m.last_node.hashes == full[:1] and leaf.hashes == full[1:]
    tree.check_invariants()


def test_merge_joins_the_hashes():
    tree, alloc = make_tree()
    put(tree, alloc, list(range(12)))
    short = put(tree, alloc, list(range(6)) + [70, 71, 72])
    tree.drop(short)                                    # the head merges back with its one child
    (only,) = tree.root().children.values()
    assert only.hashes == block_hashes(list(range(12)), B)
    assert tree.stats["merges"] == 1
    tree.check_invariants()


def test_namespaces_seed_their_own_chain():
    tree, alloc = make_tree()
    a = put(tree, alloc, list(range(8)), namespace="t1")
    b = put(tree, alloc, list(range(8)), namespace="t2")
    assert a.hashes == block_hashes(list(range(8)), B, "t1") and b.hashes == block_hashes(list(range(8)), B, "t2")
    assert a.hashes != b.hashes
    assert tree.root("t1").hashes == [salt_seed("t1")]


def test_enabling_later_hashes_what_is_cached():
    tree, alloc = make_tree(hash_block_tokens=None)
    put(tree, alloc, list(range(9)))
    put(tree, alloc, list(range(5)) + [40, 41, 42, 43])
    tree.enable_block_hashes(B)
    tree.check_invariants()                             # recomputes every node's hashes from its path
    tree.enable_block_hashes(B)                          # same size: nothing to do
    with pytest.raises(InvalidInputError, match="already keeps 4-token"):
        tree.enable_block_hashes(8)


def test_random_traffic_keeps_hashes_exact():
    rng = random.Random(3)
    tree, alloc = make_tree(num_blocks=64)
    prefixes = [[rng.randrange(30) for _ in range(rng.randrange(1, 12))] for _ in range(6)]
    for _ in range(300):
        tokens = rng.choice(prefixes) + [rng.randrange(30) for _ in range(rng.randrange(0, 9))]
        if tree.evictable_tokens > 150:
            tree.evict(40)
        put(tree, alloc, tokens, namespace=rng.choice([None, "x"]))
        tree.check_invariants()


def test_chain_hashes_u32_equals_block_hashes():
    toks = [7, 70_000, 3, 2**31 + 5, 0, 1, 2, 3, 9]
    data = encode_tokens(toks)
    assert chain_hashes_u32(data, 0, 8, B, salt_seed(None)) == block_hashes(toks, B)
    assert chain_hashes_u32(data, 4, 8, B, block_hashes(toks, B)[0]) == block_hashes(toks, B)[1:]
    assert chain_hashes_u32(data, 4, 7, B, 0) == []


def test_encode_tokens_round_trip_and_errors():
    assert decode_tokens(encode_tokens([1, 2, 3])) == [1, 2, 3]
    assert encode_tokens(encode_tokens((4, 5))) == encode_tokens([4, 5])
    with pytest.raises(InvalidInputError, match=">= 0"):
        encode_tokens([1, -1])
    with pytest.raises(InvalidInputError, match="integer ids"):
        encode_tokens([1, 2.5])
    with pytest.raises(InvalidInputError, match="<= 4294967295"):
        encode_tokens([2**32])
    with pytest.raises(InvalidInputError, match="vocab_size=10"):
        encode_tokens([3, 12], vocab_size=10)
    with pytest.raises(InvalidInputError, match="not be empty"):
        encode_tokens([])
    with pytest.raises(InvalidInputError, match="multiple of 4"):
        encode_tokens(b"abc")
