"""The core state machine, grown with tier moves: random inserts, matches,
locks, demotions (left in flight), prefetches and polls keep every invariant,
and every matched extent holds exactly the KV inserted for those tokens."""

import os
import tempfile

import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cluster.cache.kv_pool import KVLayout
from cluster.cache.radix_tree import HOT
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.errors import PoolExhaustedError

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2)
tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=14)


def kv_of(tokens):
    vals = [float(hash(tuple(tokens[:i + 1])) % 100_003) for i in range(len(tokens))]
    return torch.tensor(vals).view(1, 1, -1, 1, 1).expand(1, 2, -1, 1, 2).contiguous()


class TieredMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        cfg = TierConfig(hot_blocks=8, warm_blocks=6, cold_blocks=6, block_tokens=4, disk_dir=self.dir.name,
                         device="cpu", high_watermark=0.9, low_watermark=0.6)
        self.cache = TieredCache(cfg, LAYOUT, deterministic_io=True)
        self.locked = []

    def teardown(self):
        self.cache.close()
        self.dir.cleanup()

    def checked_admit(self, tokens):
        lease = self.cache.admit(tokens, compute_last=False)
        if lease.cached_tokens:
            assert torch.equal(lease.read(), kv_of(tokens[:lease.cached_tokens])), "wrong KV"
        return lease

    @rule(tokens=tokens_st)
    def insert(self, tokens):
        lease = self.checked_admit(tokens)
        try:
            if lease.cached_tokens < len(tokens):
                try:
                    lease.append(kv_of(tokens)[:, :, lease.cached_tokens:])
                except PoolExhaustedError:
                    return
                lease.commit(tokens)
        finally:
            lease.release()

    @rule(tokens=tokens_st)
    def match(self, tokens):
        self.checked_admit(tokens).release()

    @rule(tokens=tokens_st)
    def lock(self, tokens):
        lease = self.checked_admit(tokens)
        if lease.cached_tokens:
            self.locked.append(lease)
        else:
            lease.release()

    @precondition(lambda self: self.locked)
    @rule(i=st.integers(0, 50))
    def unlock(self, i):
        self.locked.pop(i % len(self.locked)).release()

    @rule(i=st.integers(0, 50), tier=st.integers(0, 1))
    def demote(self, i, tier):
        nodes = [n for n in self.cache.tree.iter_nodes() if n.tier == tier and not n.busy and not n.lock_ref
                 and not any(c.tier == tier for c in n.children.values())]
        if nodes:
            self.cache.moves.start_demotion(nodes[i % len(nodes)])

    @rule(tokens=tokens_st)
    def prefetch(self, tokens):
        self.cache.prefetch(tokens=tokens)

    @rule()
    def poll(self):
        self.cache.poll()

    @invariant()
    def invariants_hold(self):
        self.cache.check_invariants()
        for lease in self.locked:
            node = lease._node
            assert node.alive and node.tier == HOT, "a locked node was dropped or demoted"


TieredMachine.TestCase.settings = settings(max_examples=int(os.environ.get("HYPOTHESIS_EXAMPLES", 40)), stateful_step_count=30, deadline=None)
TestTieredMachine = TieredMachine.TestCase
