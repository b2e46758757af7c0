"""Property-based test of the slotted allocator on its own: random allocate
(fresh, continuing a sequence, private tails), free, split, join, grow and
open/close keep the occupancy bitmasks and the free-run index exact
(``check_invariants`` rebuilds both from the extents), and no two live
extents ever overlap."""

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cluster.cache.allocator import AllocatorConfig, BlockAllocator, Extent
from cluster.errors import PoolExhaustedError

BT = 8


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc = BlockAllocator(AllocatorConfig(num_blocks=6, block_tokens=BT, mode="slotted"))
        self.live: list[Extent] = []

    @rule(n=st.integers(1, 2 * BT + 3), continue_one=st.booleans(), pick=st.integers(0, 1 << 16),
          private_tail=st.booleans())
    def allocate(self, n, continue_one, pick, private_tail):
        after = self.live[pick % len(self.live)] if continue_one and self.live else None
        room = self.alloc.room_after(after) if after is not None else 0
        free_before, used_before = self.alloc.free_blocks, self.alloc.used_tokens
        try:
            out = self.alloc.allocate(n, private_tail=private_tail, after=after)
        except PoolExhaustedError:
            # All or nothing: a refused request changed nothing.
            assert (self.alloc.free_blocks, self.alloc.used_tokens) == (free_before, used_before)
            return
        assert sum(e.length for e in out) == n
        if room:   # the sequence grows right behind itself first
            assert out[0] == Extent(after.block_id, after.offset + after.length, min(n, room))
        self.live.extend(out)

    @precondition(lambda self: self.live)
    @rule(picks=st.lists(st.integers(0, 1 << 16), min_size=1, max_size=4))
    def free(self, picks):
        chosen = list(dict.fromkeys(self.live[p % len(self.live)] for p in picks))
        self.alloc.free(chosen)
        for e in chosen:
            self.live.remove(e)

    @precondition(lambda self: any(e.length > 1 for e in self.live))
    @rule(pick=st.integers(0, 1 << 16), at=st.integers(1, BT - 1))
    def split(self, pick, at):
        e = [x for x in self.live if x.length > 1][pick % sum(x.length > 1 for x in self.live)]
        at = 1 + at % (e.length - 1)
        first, second = self.alloc.split(e, at)
        self.live[self.live.index(e):self.live.index(e) + 1] = [first, second]

    @precondition(lambda self: len(self.live) > 1)
    @rule(pick=st.integers(0, 1 << 16))
    def join(self, pick):
        first = self.live[pick % len(self.live)]
        second = next((e for e in self.live if e.block_id == first.block_id
                       and e.offset == first.offset + first.length), None)
        if second is None:
            return
        joined = self.alloc.try_join(first, second)
        assert joined == Extent(first.block_id, first.offset, first.length + second.length)
        self.live.remove(second)
        self.live[self.live.index(first)] = joined

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1 << 16), n=st.integers(1, BT))
    def grow(self, pick, n):
        e = self.live[pick % len(self.live)]
        room = self.alloc.room_after(e)
        grown = self.alloc.try_grow(e, n)
        if grown is None:
            assert self.alloc.refcount[e.block_id] != 1 or room == 0
            return
        assert grown == Extent(e.block_id, e.offset, e.length + min(n, room))
        self.live[self.live.index(e)] = grown

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1 << 16), is_open=st.booleans())
    def open_or_close(self, pick, is_open):
        self.alloc.set_open(self.live[pick % len(self.live)].block_id, is_open)

    @invariant()
    def consistent(self):
        self.alloc.check_invariants()
        taken = set()
        for b, off, length in self.live:
            cells = {(b, off + i) for i in range(length)}
            assert not taken & cells, "two live extents overlap"
            taken |= cells
        assert len(taken) == self.alloc.used_tokens


AllocatorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase
