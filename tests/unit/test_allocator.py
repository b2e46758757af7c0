import pytest

from cluster.cache.allocator import AllocatorConfig, BlockAllocator, Extent
from cluster.errors import InvalidInputError, PoolExhaustedError


def make(num_blocks=8, block_tokens=8, mode="slotted"):
    return BlockAllocator(AllocatorConfig(num_blocks=num_blocks, block_tokens=block_tokens, mode=mode))


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_blocks=0), "num_blocks"),
    (dict(num_blocks=-3), "num_blocks"),
    (dict(num_blocks=4, block_tokens=0), "block_tokens"),
    (dict(num_blocks=4, mode="paged"), "mode"),
    (dict(num_blocks=4, block_tokens=4, mode="token"), "block_tokens=1"),
])
def test_bad_config_names_the_field(kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        AllocatorConfig(**kwargs)


def test_long_span_gets_whole_blocks_and_remainder_a_slot():
    a = make()
    assert a.allocate(19) == [Extent(0, 0, 8), Extent(1, 0, 8), Extent(2, 0, 3)]
    # Short spans pack into the open block 2 after the first slot.
    assert a.allocate(5) == [Extent(2, 3, 5)]
    assert a.used_blocks == 3 and a.used_tokens == 24
    a.check_invariants()


def test_flat_mode_never_shares_a_block():
    a = make(mode="flat")
    assert a.allocate(3) == [Extent(0, 0, 3)]
    assert a.allocate(3) == [Extent(1, 0, 3)]
    assert a.internal_fragmentation() == pytest.approx(10 / 16)
    a.check_invariants()


def test_best_fit_prefers_the_smallest_room():
    a = make()
    a.allocate(6)          # block 0: room 2
    a.allocate(3)          # block 0 cannot take 3 -> block 1, room 5
    assert a.allocate(2) == [Extent(0, 6, 2)]
    assert a.allocate(4) == [Extent(1, 3, 4)]
    a.check_invariants()


def test_freed_slot_is_reused_before_a_new_block():
    a = make()
    first, second, third = a.allocate(3)[0], a.allocate(3)[0], a.allocate(2)[0]
    assert (first.block_id, second.block_id, third.block_id) == (0, 0, 0)
    a.free([second])
    assert a.allocate(3) == [Extent(0, 3, 3)]
    a.check_invariants()


def test_block_returns_to_free_list_when_last_extent_goes():
    a = make(num_blocks=2)
    x = a.allocate(4)
    y = a.allocate(4)
    assert a.free_blocks == 1
    a.free(x)
    a.free(y)
    assert a.free_blocks == 2 and a.used_tokens == 0
    a.check_invariants()


def test_exhaustion_is_all_or_nothing():
    a = make(num_blocks=2)
    a.allocate(8)
    with pytest.raises(PoolExhaustedError, match="need 2 free blocks, 1 left") as info:
        a.allocate(16)
    assert info.value.needed_blocks == 2 and info.value.free_blocks == 1
    assert a.free_blocks == 1
    a.check_invariants()


def test_double_free_and_stale_extents_are_rejected_without_damage():
    a = make()
    (e,) = a.allocate(5)
    a.free([e])
    with pytest.raises(InvalidInputError, match="not allocated"):
        a.free([e])
    (f,) = a.allocate(5)
    with pytest.raises(InvalidInputError, match="listed twice"):
        a.free([f, f])
    with pytest.raises(InvalidInputError, match="block_id outside"):
        a.free([Extent(99, 0, 1)])
    with pytest.raises(InvalidInputError, match="not allocated"):
        a.free([Extent(f.block_id, f.offset, 4)])   # wrong length
    assert a.used_tokens == 5
    a.check_invariants()


def test_bad_sizes_are_rejected():
    a = make()
    for bad in (0, -1, 2.5, "3"):
        with pytest.raises(InvalidInputError, match="num_tokens"):
            a.allocate(bad)
    a.check_invariants()


def test_split_keeps_one_block_and_counts_two_extents():
    a = make()
    (e,) = a.allocate(6)
    left, right = a.split(e, 2)
    assert (left, right) == (Extent(0, 0, 2), Extent(0, 2, 4))
    assert a.refcount[0] == 2 and a.used[0] == 6
    assert a.try_join(left, right) == Extent(0, 0, 6)
    assert a.refcount[0] == 1
    with pytest.raises(InvalidInputError, match="split point"):
        a.split(Extent(0, 0, 6), 6)
    a.check_invariants()


def test_private_tail_grows_in_place_and_is_not_shared():
    a = make()
    (tail,) = a.allocate(3, private_tail=True)
    assert a.allocate(2) == [Extent(1, 0, 2)]       # the private block takes no slot
    assert a.try_grow(tail, 4) == Extent(0, 0, 7)
    assert a.try_grow(Extent(0, 0, 7), 4) == Extent(0, 0, 8)   # capped by the block
    assert a.try_grow(Extent(0, 0, 8), 1) is None
    a.check_invariants()


def test_token_mode_has_no_internal_fragmentation():
    a = BlockAllocator(AllocatorConfig.token_granular(16))
    ext = a.allocate(5)
    assert [e.length for e in ext] == [1] * 5
    assert a.internal_fragmentation() == 0.0
    a.check_invariants()


@pytest.mark.parametrize("mode", ["slotted", "flat"])
def test_allocate_after_grows_the_sequence_tail_block_first(mode):
    a = make(mode=mode)
    (tail,) = a.allocate(3)                              # block 0, 5 slots free behind it
    assert a.allocate(7, after=tail) == [Extent(0, 3, 5), Extent(1, 0, 2)]
    assert a.refcount[0] == 2 and a.used_blocks == 2
    a.check_invariants()


def test_flat_remainder_without_after_takes_a_block_of_its_own():
    a = make(mode="flat")
    a.allocate(3)
    assert a.allocate(3) == [Extent(1, 0, 3)]            # flat never shares a block between sequences
    a.check_invariants()


def test_allocate_after_a_packed_extent_takes_nothing_behind_it():
    a = make()
    (first,) = a.allocate(3)
    a.allocate(2)                                        # a slot packed right behind `first`
    assert a.room_after(first) == 0
    assert a.allocate(2, after=first) == [Extent(0, 5, 2)]   # best fit elsewhere: the same block's tail
    a.check_invariants()


def test_slot_placement_takes_the_best_fitting_free_run():
    a = make(num_blocks=2, block_tokens=16)
    exts = [a.allocate(n)[0] for n in (2, 3, 2, 4, 2, 3)]   # block 0: [0,2) [2,5) [5,7) [7,11) [11,13) [13,16)
    a.free([exts[1], exts[3]])                           # inner gaps of 3 (at 2) and 4 (at 7)
    assert a.allocate(3) == [Extent(0, 2, 3)]            # best fit: the 3-gap, not the 4-gap
    assert a.free_runs(0) == [(7, 4)] and a.largest_gap(0) == 4
    assert a.allocate(2) == [Extent(0, 7, 2)]
    assert a.free_runs(0) == [(9, 2)]
    a.check_invariants()


def test_metadata_bytes_counts_the_real_tables():
    a = make(num_blocks=4)
    empty = a.metadata_bytes()
    a.allocate(12)
    used = a.metadata_bytes()
    assert used > empty                                  # the live tables of two blocks appeared
    exts = [Extent(0, 0, 8)]
    assert a.metadata_bytes(exts) > used                 # a node's extent list counts when passed


def test_freed_slots_merge_with_the_free_runs_on_both_sides():
    a = make(num_blocks=2, block_tokens=16)
    exts = [a.allocate(n)[0] for n in (3, 4, 5)]          # block 0: [0,3) [3,7) [7,12), run [12,16)
    a.free([exts[0]])
    assert a.free_runs(0) == [(0, 3), (12, 4)]
    a.free([exts[2]])                                     # merges with the tail run
    assert a.free_runs(0) == [(0, 3), (7, 9)]
    a.free([exts[1]])                                     # the last extent: the block is free again
    assert a.free_blocks == 2 and a.free_runs(0) == [(0, 16)]
    a.check_invariants()


def test_a_grow_that_leaves_a_rest_does_not_count_its_own_run_as_a_slot():
    a = make(num_blocks=3, block_tokens=8)
    (seq,) = a.allocate(5)                                # block 0: run [5,8) of 3
    # 3 grow behind `seq`, the remaining 2 need another slot: not the run the grow took.
    assert a.allocate(5, after=seq) == [Extent(0, 5, 3), Extent(1, 0, 2)]
    a.check_invariants()


def test_slots_find_the_best_fit_across_blocks():
    a = make(num_blocks=3, block_tokens=8)
    a.allocate(2)                                         # block 0: run of 6
    a.allocate(5, private_tail=True)                      # block 1: private, closed
    a.set_open(1, True)                                   # block 1: run of 3 open to slots
    assert a.allocate(3) == [Extent(1, 5, 3)]             # the exact fit, not block 0's 6
    assert a.allocate(4) == [Extent(0, 2, 4)]
    a.check_invariants()


def test_a_block_held_whole_keeps_its_pair_as_its_table_until_it_is_split():
    a = make()
    owner, other = object(), object()
    whole = a.allocate(16, owner)
    assert whole == [Extent(0, 0, 8), Extent(1, 0, 8)]
    # Both blocks share one (length, owner) pair, no dict per block.
    assert a.live[0] is a.live[1] and a.live[0] == (8, owner)
    assert a.extents_at(0) == {0: (8, owner)} and a.extents_at(5) == {}
    assert a.owner_of(whole[1]) is owner
    a.set_owners(whole, other)
    assert a.owner_of(whole[0]) is other and a.live[0] is a.live[1]
    # Not extents of the whole block: rejected, nothing changed.
    for bad in (Extent(0, 0, 4), Extent(0, 4, 4), Extent(0, 1, 8)):
        with pytest.raises(InvalidInputError, match="not allocated"):
            a.owner_of(bad)
        with pytest.raises(InvalidInputError, match="not allocated"):
            a.set_owners([bad], owner)
        with pytest.raises(InvalidInputError, match="not allocated"):
            a.free([whole[0], bad])
    assert a.owner_of(whole[0]) is other and a.used_tokens == 16
    # A split gives the block a table of two extents; joining keeps it a dict.
    left, right = a.split(whole[0], 3)
    assert a.extents_at(0) == {0: (3, other), 3: (5, other)} and type(a.live[0]) is dict
    assert a.live[1] == (8, other)
    joined = a.try_join(left, right)
    assert joined == Extent(0, 0, 8) and a.owner_of(joined) is other
    a.set_owner(whole[1], owner)
    assert a.live[1] == (8, owner) and a.owner_of(joined) is other
    a.check_invariants()
    a.free([joined, whole[1]])
    assert a.live[0] is None and a.live[1] is None and a.used_tokens == 0
    with pytest.raises(InvalidInputError, match="not allocated"):
        a.free([whole[1]])
    a.check_invariants()
