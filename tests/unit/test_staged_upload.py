"""COLD -> HOT through staging buffers (``StagedUpload``): chunking, mixed runs,
a bad block mid-run, and on CUDA no device-wide synchronize."""

import pytest
import torch

from cluster.cache.allocator import Extent
from cluster.cache.radix_tree import COLD, HOT, WARM
from cluster.cache.upload import StagedUpload, slice_extents
from tests.unit.test_tiered import demote, kv_for, make, match, put


def test_slice_extents_cuts_at_token_positions():
    exts = [Extent(3, 0, 4), Extent(7, 2, 2), Extent(1, 0, 3)]
    assert slice_extents(exts, 0, 9) == exts
    assert slice_extents(exts, 2, 5) == [Extent(3, 2, 2), Extent(7, 2, 1)]
    assert slice_extents(exts, 5, 9) == [Extent(7, 3, 1), Extent(1, 0, 3)]
    assert slice_extents(exts, 4, 4) == []


def _staged(cache, chunk_blocks):
    cache.moves.upload = StagedUpload(cache.hot, cache.pools[COLD], chunk_blocks=chunk_blocks)
    return cache.moves.upload


@pytest.mark.parametrize("chunk_blocks", [1, 2, 3, 16])
def test_a_path_of_slotted_nodes_comes_up_exact_in_any_chunking(tmp_path, chunk_blocks):
    """Three nodes (10, 7 and 13 tokens: slots share blocks), the first in WARM,
    the others in COLD; one promotion brings the path up bit-exact."""
    cache = make(tmp_path, hot=16, warm=16, cold=16)
    _staged(cache, chunk_blocks)
    a, b, c = list(range(10)), list(range(10, 17)), list(range(17, 30))
    nodes = [put(cache, a), put(cache, a + b), put(cache, a + b + c)]
    for node in reversed(nodes):
        demote(cache, node, WARM)
    demote(cache, nodes[2], COLD)
    demote(cache, nodes[1], COLD)
    m = match(cache, a + b + c)
    assert m.tier_lengths == [0, 10, 20] and m.length == 30
    assert all(n.tier == HOT for n in nodes)
    expected = torch.cat([kv_for(a), kv_for(a + b)[:, :, 10:], kv_for(a + b + c)[:, :, 17:]], dim=2)
    assert torch.equal(m.kv, expected)
    cache.check_invariants()
    cache.close()


@pytest.mark.parametrize("chunk_blocks", [1, 2, 4, 16])
def test_a_bad_block_mid_run_keeps_every_node_before_it_whole(tmp_path, chunk_blocks):
    """A root-ward run of three COLD nodes (8, 8 and 4 tokens); the second
    node's second block is corrupt. The first node comes up exact whatever
    chunk it shared with the bad block; the second and everything below it go."""
    cache = make(tmp_path, hot=16, warm=16, cold=16)
    upload = _staged(cache, chunk_blocks)
    toks = list(range(20))
    nodes = [put(cache, toks[:8]), put(cache, toks[:16]), put(cache, toks)]
    for node in reversed(nodes):
        demote(cache, node, COLD)
    cache.pools[COLD].corrupt_block_for_test(nodes[1].extents[1].block_id)
    m = match(cache, toks)
    assert m.length == 8 and nodes[0].tier == HOT
    assert torch.equal(m.kv, kv_for(toks[:8]))
    assert not nodes[1].alive and not nodes[2].alive
    assert cache.stats["checksum_failures"] == 1
    assert cache.stats["dropped_cold_checksum_tokens"] == 12
    assert upload._pending == [None, None]   # no copy left reading a staging buffer
    cache.check_invariants()
    cache.close()


def test_the_staging_buffers_are_allocated_once_and_reused(tmp_path):
    cache = make(tmp_path, hot=16, warm=16, cold=16)
    upload = _staged(cache, 2)
    toks = list(range(24))
    node = put(cache, toks)
    demote(cache, node, COLD)
    match(cache, toks)
    first = [b.data_ptr() for b in upload._bufs]
    assert len(first) == 2 and upload._bufs[0].shape == (2, *cache.pools[COLD].block_shape)
    demote(cache, node, COLD)
    assert torch.equal(match(cache, toks).kv, kv_for(toks))
    assert [b.data_ptr() for b in upload._bufs] == first
    cache.close()


def test_a_block_read_refuses_a_buffer_that_is_not_one_host_block(tmp_path):
    cache = make(tmp_path)
    cold = cache.pools[COLD]
    with pytest.raises(ValueError, match="not one block"):
        cold.read_block_into(0, torch.empty(2, *cold.block_shape))
    cache.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cold_promotion_uses_pinned_staging_and_never_synchronizes_the_device(tmp_path, monkeypatch):
    from cluster.cache.tiered import TierConfig, TieredCache
    from tests.unit.test_tiered import LAYOUT
    from tests.unit.helpers import TickClock
    cfg = TierConfig(hot_blocks=16, warm_blocks=16, cold_blocks=16, block_tokens=4, disk_dir=str(tmp_path))
    cache = TieredCache(cfg, LAYOUT, clock=TickClock())
    assert cache.moves.upload.stream is cache.copier.stream
    toks = list(range(22))
    node = put(cache, toks)
    demote(cache, node, COLD)

    def refuse(*args, **kwargs):
        raise AssertionError("a device-wide synchronize on a promotion")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", refuse)
    m = match(cache, toks)
    assert all(b.is_pinned() for b in cache.moves.upload._bufs)
    assert torch.equal(m.kv.cpu(), kv_for(toks))
    monkeypatch.undo()
    cache.close()
