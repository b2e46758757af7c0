"""A lease's slot table: where in HOT each position it holds lies, through copy-on-write
appends, reservations written in place and checkpoints into the tree."""

import random

import pytest
import torch

from cluster.cache.kv_pool import KVLayout
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.errors import CacheError
from tests.unit.helpers import TickClock

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4)
BT = 4


def make_cache(hot=64):
    return TieredCache(TierConfig(hot_blocks=hot, warm_blocks=0, cold_blocks=0, block_tokens=BT, device="cpu"),
                       LAYOUT, clock=TickClock())


def at_slots(cache, slots):
    pool = cache.hot.tensor
    return pool[slots // BT, :, :, slots % BT].permute(1, 2, 0, 3, 4)


def write_at(cache, slots, kv):
    """What a paged forward does: the new tokens' KV straight into their slots."""
    pool = cache.hot.tensor
    pool[slots // BT, :, :, slots % BT] = kv.permute(2, 0, 1, 3, 4)


def kv_of(n, seed):
    return torch.randn(LAYOUT.num_layers, 2, n, 1, 4, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("seed", range(6))
def test_the_slot_table_names_where_every_position_lies(seed):
    """Random leases over shared prefixes grow by appends, by reservations written in place
    through their slots, and checkpoint into the tree; after every change the slot table has
    one slot per position (then the reserved room), distinct, and the pool at those slots
    holds exactly the KV the lease holds. Copy-on-write of a shared tail happens on the way."""
    rng = random.Random(seed)
    cache = make_cache()
    system = [rng.randrange(100) for _ in range(6)]   # not a whole block: later prompts share its tail slot
    first = cache.admit(system, compute_last=False)
    first.append(kv_of(len(system), seed))
    first.commit(system)
    first.release()
    for step in range(8):
        tokens = system + [rng.randrange(100) for _ in range(rng.randrange(1, 5))]
        lease = cache.admit(tokens, compute_last=False)
        held = lease.read().clone()
        expect = torch.cat([held, kv_of(len(tokens) - lease.cached_tokens, 100 * seed + step)], dim=2)
        pos = lease.cached_tokens
        while pos < len(tokens):
            n = min(rng.randrange(1, 4), len(tokens) - pos)
            if rng.random() < 0.5:
                lease.append(expect[:, :, pos:pos + n])
            else:
                lease.reserve(n)
                slots = lease.slots()
                assert slots.numel() == pos + n and lease.reserved_tokens == n
                write_at(cache, slots[pos:], expect[:, :, pos:pos + n])
                lease.written(n)
            pos += n
            slots = lease.slots()
            assert slots.numel() == lease.length == pos and len(set(slots.tolist())) == pos
            assert torch.equal(at_slots(cache, slots), expect[:, :, :pos])
            assert torch.equal(lease.read(), expect[:, :, :pos])
            if rng.random() < 0.3:
                lease.checkpoint(tokens[:pos])   # the tree's slots now
                assert torch.equal(at_slots(cache, lease.slots()), expect[:, :, :pos])
        lease.commit(tokens)
        lease.release()
    cache.check_invariants()


def test_copy_on_write_of_a_shared_tail_moves_its_slots():
    """Two short prompts share one block as slots; the second grows: its tail is copied to a
    block of its own first, and its slot table follows (the old slots keep the first's KV)."""
    cache = make_cache()
    a = cache.admit([1, 2], compute_last=False)
    a.append(kv_of(2, 1))
    b = cache.admit([3, 4], compute_last=False)
    b.append(kv_of(2, 2))
    before = b.slots().clone()
    assert set((before // BT).tolist()) == set((a.slots() // BT).tolist())   # one block, two slots
    b.reserve(3)
    write_at(cache, b.slots()[2:], kv_of(3, 3))
    b.written(3)
    assert cache.hot.cow_copies == 1
    after = b.slots()
    assert not set(after[:2].tolist()) & set(before.tolist())
    assert torch.equal(at_slots(cache, after), torch.cat([kv_of(2, 2), kv_of(3, 3)], dim=2))
    assert torch.equal(at_slots(cache, a.slots()), kv_of(2, 1))
    a.release()
    b.release()


def test_a_reservation_is_confirmed_whole_or_not_at_all():
    """``written`` of another count than reserved changes nothing; a commit with the room
    unwritten is refused; a release frees the room with the lease."""
    cache = make_cache()
    lease = cache.admit([1, 2, 3, 4, 5], compute_last=False)
    lease.reserve(3)
    with pytest.raises(CacheError, match="does not match the reserved room of 3"):
        lease.written(2)
    assert (lease.length, lease.reserved_tokens, lease.slots().numel()) == (0, 3, 3)
    with pytest.raises(CacheError, match="not written"):
        lease.commit([1, 2, 3])
    with pytest.raises(CacheError, match="while an earlier reservation"):
        lease.reserve(1)
    lease.written(3)
    assert (lease.length, lease.reserved_tokens) == (3, 0)
    lease.reserve(2)
    lease.release()   # the room is freed with the lease
    assert cache.hot.allocator.free_blocks == cache.hot.allocator.num_blocks
