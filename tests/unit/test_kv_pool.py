import sys

import pytest
import torch

from cluster.cache.allocator import AllocatorConfig, Extent
from cluster.cache.kv_pool import KVLayout, KVPool
from cluster.cache.radix_tree import RadixTree
from cluster.errors import InvalidInputError, PoolExhaustedError

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4)


def kv_for(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.num_layers, 2, n, LAYOUT.num_kv_heads, LAYOUT.head_dim, generator=g)


def make_pool(num_blocks=16, block_tokens=8, mode="slotted"):
    return KVPool(AllocatorConfig(num_blocks=num_blocks, block_tokens=block_tokens, mode=mode), LAYOUT)


def test_pool_shape_is_block_first():
    pool = make_pool()
    assert tuple(pool.tensor.shape) == (16, 2, 2, 8, 2, 4)
    assert pool.block_bytes == 2 * 2 * 8 * 2 * 4 * 4
    assert pool.tensor[3].is_contiguous()


def _resident_bytes(tensor):
    """The resident bytes of the pages under ``tensor`` (``mincore``: page by page, so an
    adjacent mapping the kernel merged with the pool's does not count)."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    begin = tensor.data_ptr() // page * page
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    pages = (end - begin + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    if libc.mincore(ctypes.c_void_p(begin), ctypes.c_size_t(end - begin), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) * page


def test_a_cpu_pool_is_zero_when_built_and_mapping_its_pages_keeps_what_it_holds():
    assert int(torch.count_nonzero(make_pool().tensor)) == 0
    pool = KVPool(AllocatorConfig(num_blocks=16, block_tokens=8), LAYOUT, prefault=False)
    assert int(torch.count_nonzero(pool.tensor)) == 0   # no write: the OS's zero pages
    pool.tensor[3].fill_(7.0)   # the engine writes while the pages are mapped after ready
    done = pool.prefault()
    assert done["bytes"] == pool.tensor.numel() * pool.tensor.element_size()
    assert int(torch.count_nonzero(pool.tensor)) == pool.tensor[3].numel()
    assert bool((pool.tensor[3] == 7.0).all())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps")
def test_a_deferred_pool_maps_no_page_until_it_is_prefaulted_or_written():
    pool = KVPool(AllocatorConfig(num_blocks=256, block_tokens=16), KVLayout(4, 4, 64), prefault=False)
    size = pool.tensor.numel() * pool.tensor.element_size()   # 16 MiB
    assert _resident_bytes(pool.tensor) == 0
    pool.tensor[0].fill_(1.0)   # a first write maps its own pages (a huge page where THP is always on)
    assert pool.block_bytes <= _resident_bytes(pool.tensor) <= max(pool.block_bytes, 2 << 20)
    done = pool.prefault(stop=lambda: False)
    if not done["supported"]:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    assert done["bytes"] == size
    assert _resident_bytes(pool.tensor) == size
    assert int(torch.count_nonzero(pool.tensor)) == pool.tensor[0].numel()


def test_write_then_read_round_trips_across_extents():
    pool = make_pool()
    ext = pool.allocator.allocate(19)
    kv = kv_for(19, 0)
    pool.write(ext, kv)
    assert torch.equal(pool.read(ext), kv)
    assert torch.equal(pool.read(ext[1:2]), kv[:, :, 8:16])
    with pytest.raises(InvalidInputError, match="does not fit"):
        pool.write(ext, kv[:, :, :5])


def test_layout_validation_names_the_field():
    with pytest.raises(InvalidInputError, match="head_dim"):
        KVLayout(num_layers=1, num_kv_heads=1, head_dim=0)
    with pytest.raises(InvalidInputError, match="dtype"):
        KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype="int8")


def test_append_copies_a_shared_tail_before_growing():
    pool = make_pool()
    alloc = pool.allocator
    (neighbour,) = alloc.allocate(3)
    pool.write([neighbour], kv_for(3, 1))
    seq = alloc.allocate(4)              # lands as a slot next to the neighbour: shared block
    assert seq == [Extent(0, 3, 4)] and alloc.is_shared(seq[0])
    pool.write(seq, kv_for(4, 2))
    seq, new = pool.append(seq, 6)
    assert pool.cow_copies == 1
    assert seq[0].block_id != 0 and not alloc.is_shared(seq[0])
    assert sum(e.length for e in seq) == 10 and sum(e.length for e in new) == 6
    pool.write(new, kv_for(6, 3))
    assert torch.equal(pool.read(seq), torch.cat([kv_for(4, 2), kv_for(6, 3)], dim=2))
    # The neighbour's KV was not touched by the copy or the append.
    assert torch.equal(pool.read([neighbour]), kv_for(3, 1))
    alloc.check_invariants()


def test_append_to_a_private_tail_grows_in_place():
    pool = make_pool()
    seq, new = pool.append([], 3)
    assert seq == new == [Extent(0, 0, 3)]
    seq, new = pool.append(seq, 2)
    assert seq == [Extent(0, 0, 5)] and new == [Extent(0, 3, 2)] and pool.cow_copies == 0
    seq, new = pool.append(seq, 5)     # fills block 0, spills into a fresh block
    assert seq == [Extent(0, 0, 8), Extent(1, 0, 2)]
    pool.allocator.check_invariants()


def test_append_is_all_or_nothing_when_full():
    pool = make_pool(num_blocks=2)
    seq, _ = pool.append([], 8)
    with pytest.raises(PoolExhaustedError):
        pool.append(seq, 20)
    assert pool.allocator.used_tokens == 8
    pool.allocator.check_invariants()


def test_compaction_moves_data_and_updates_the_tree():
    pool = make_pool(num_blocks=8, block_tokens=8)
    tree = RadixTree(pool.allocator)
    expected = {}
    # Eight short sequences of 4 tokens pack two per block (4 blocks).
    for i in range(8):
        toks = [100 + i] * 4
        ext = pool.allocator.allocate(4)
        pool.write(ext, kv_for(4, i))
        tree.insert(toks, ext)
        expected[i] = kv_for(4, i)
    assert pool.allocator.used_blocks == 4
    # Drop every other sequence: four half-empty blocks.
    for i in range(0, 8, 2):
        leaf = tree.match_prefix([100 + i] * 4).last_node
        tree.drop(leaf)
    assert pool.allocator.used_blocks == 4
    freed = pool.compact(max_blocks_moved=8, can_move=lambda n: n is not None and n.lock_ref == 0)
    assert freed == 2 and pool.allocator.used_blocks == 2
    for i in range(1, 8, 2):
        m = tree.match_prefix([100 + i] * 4)
        assert m.length == 4
        assert torch.equal(pool.read(m.extents), expected[i])
    tree.check_invariants()


def test_compaction_never_moves_locked_nodes():
    pool = make_pool(num_blocks=8, block_tokens=8)
    tree = RadixTree(pool.allocator)
    nodes = []
    for i in range(4):
        ext = pool.allocator.allocate(4)
        pool.write(ext, kv_for(4, i))
        nodes.append(tree.insert([i] * 4, ext).node)
    tree.drop(nodes[1])
    tree.drop(nodes[3])
    for n in (nodes[0], nodes[2]):
        tree.lock(n)
    before = [list(n.extents) for n in (nodes[0], nodes[2])]
    assert pool.compact(8, can_move=lambda n: n is not None and n.lock_ref == 0) == 0
    assert [n.extents for n in (nodes[0], nodes[2])] == before
    tree.check_invariants()
