"""Property-based test: random cache operations keep every invariant and every
matched extent holds exactly the KV that was inserted for those tokens."""

import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cluster.cache.allocator import AllocatorConfig
from cluster.cache.kv_pool import KVLayout, KVPool
from cluster.cache.radix_tree import RadixTree
from cluster.errors import PoolExhaustedError

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2)
tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=14)
namespace_st = st.sampled_from([None, "t1"])


def kv_of(tokens, namespace):
    """Deterministic KV for each position, a function of the prefix up to it."""
    vals = [float(hash((namespace, tuple(tokens[:i + 1]))) % 100_003) for i in range(len(tokens))]
    t = torch.tensor(vals, dtype=torch.float32)
    return t.view(1, 1, -1, 1, 1).expand(1, 2, -1, 1, 2).contiguous()


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = KVPool(AllocatorConfig(num_blocks=12, block_tokens=4), LAYOUT)
        self.tree = RadixTree(self.pool.allocator)
        self.locked = []   # nodes we hold a lock on

    def check_match(self, tokens, namespace):
        m = self.tree.match_prefix(tokens, namespace)
        if m.length:
            got = self.pool.read(m.extents)
            assert torch.equal(got, kv_of(tokens[:m.length], namespace)), "matched KV differs from inserted KV"
        return m

    @rule(tokens=tokens_st, namespace=namespace_st)
    def insert(self, tokens, namespace):
        m = self.check_match(tokens, namespace)
        rest = len(tokens) - m.length
        if not rest:
            return
        self.tree.lock(m.last_node)
        try:
            while True:
                try:
                    ext = self.pool.allocator.allocate(rest)
                    break
                except PoolExhaustedError:
                    if self.tree.evict(4) == 0:
                        return
            self.pool.write(ext, kv_of(tokens, namespace)[:, :, m.length:])
            self.tree.insert(tokens, ext, namespace, start=m.length)
        finally:
            self.tree.unlock(m.last_node)

    @rule(tokens=tokens_st, namespace=namespace_st)
    def match(self, tokens, namespace):
        self.check_match(tokens, namespace)

    @rule(tokens=tokens_st, namespace=namespace_st)
    def lock(self, tokens, namespace):
        m = self.check_match(tokens, namespace)
        if m.length:
            self.tree.lock(m.last_node)
            self.locked.append(m.last_node)

    @precondition(lambda self: self.locked)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        self.tree.unlock(self.locked.pop(i % len(self.locked)))

    @rule(n=st.integers(0, 20))
    def evict(self, n):
        before = self.tree.protected_tokens
        self.tree.evict(n)
        assert self.tree.protected_tokens == before
        assert all(node.alive for node in self.locked), "a locked node was evicted"

    @rule(k=st.integers(1, 4))
    def compact(self, k):
        self.pool.compact(k, can_move=lambda n: n is not None and n.lock_ref == 0)

    @invariant()
    def invariants_hold(self):
        self.tree.check_invariants()


CacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestCacheMachine = CacheMachine.TestCase
