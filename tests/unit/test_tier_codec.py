"""Compressed lower tiers (``cluster.cache.codec``): the codec's bounds, what the tiers
store and checksum, the L3 key, mixed formats refused, promotion restoring exactly what
the codec decodes, the config, and the tier tests of test_tiered.py again under int8."""

import threading

import numpy as np
import pytest
import torch
import xxhash

import tests.unit.test_staged_upload as tsu
import tests.unit.test_tiered as tt
from actors.config import WorkerConfig
from cluster.cache.codec import (FORMAT_VERSION, SCALE_STEPS, CodecMismatchError, TierCodec, make_codec,
                                 rotation, scale_of)
from cluster.cache.kv_pool import KVLayout
from cluster.cache.l3.memory import MemoryL3Store
from cluster.cache.l3.store import kv_layout_version
from cluster.cache.l3.tier import L3Tier, L3TierConfig
from cluster.cache.l3.wire import L3Block, L3Lookup, l3_key
from cluster.cache.radix_tree import COLD, HOT, WARM
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.errors import ChecksumError, InvalidInputError
from cluster.hashing import block_hashes
from tests.unit.helpers import TickClock

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4)
INT8 = make_codec("int8", torch.float32, 4)


def kv(tokens: int, seed: int = 0, layout: KVLayout = LAYOUT) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(layout.num_layers, 2, tokens, layout.num_kv_heads, layout.head_dim, generator=g)
    return x * torch.logspace(-3, 2, tokens).view(1, 1, tokens, 1, 1)   # rows of very different sizes


def stored_rows(q: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Stored bytes from codes ``q`` (``[..., d]``) and scale codes (``[..., 1]``)."""
    return torch.cat([q, code], dim=-1).to(torch.int8)


def exact_kv_for(tokens):
    """KV the int8 codec stores exactly: what it decodes from codes in [-127, 127] with a
    127 in every row (so encoding it again finds the same scale and the same codes)."""
    g = torch.Generator().manual_seed(hash(tuple(tokens)) % (2 ** 31))
    q = torch.randint(-127, 128, (LAYOUT.num_layers, 2, len(tokens), 1, 4), generator=g)
    q[..., 0] = 127
    code = torch.randint(-60, 30, (LAYOUT.num_layers, 2, len(tokens), 1, 1), generator=g)
    return INT8.decode(stored_rows(q, code))


def cache(tmp_path, codec="int8", hot=8, warm=8, cold=16, **kw):
    cfg = TierConfig(hot_blocks=hot, warm_blocks=warm, cold_blocks=cold, block_tokens=4, device="cpu",
                     disk_dir=str(tmp_path) if cold else None, tier_codec=codec, **kw)
    return TieredCache(cfg, LAYOUT, clock=TickClock(), deterministic_io=True)


# ------------------------------------------------------------------ the codec
def test_the_rotation_is_a_block_diagonal_hadamard_matrix_its_own_inverse_up_to_b():
    cpu = torch.device("cpu")
    for d, b in ((4, 4), (64, 64), (128, 128), (80, 16), (96, 32), (6, 2), (3, 1)):
        r = rotation(d, cpu)
        assert make_codec("int8", torch.float32, d).rotation_block == b
        assert torch.equal(r, r.T) and torch.equal(r @ r, b * torch.eye(d))
        assert set(r.unique().tolist()) <= {-1.0, 0.0, 1.0} and int((r != 0).sum()) == d * b
        assert torch.equal(r[:b, b:], torch.zeros(b, d - b))   # blocks never mix across
    assert torch.equal(rotation(4, cpu), torch.tensor([[1., 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1],
                                                        [1, -1, -1, 1]]))


def test_int8_round_trip_error_is_within_half_a_step_of_each_rotated_row():
    x = kv(64)
    x[0, 0, 5] = 0.0                                  # an all-zero row
    x[1, 1, 9, 0, 2] = 1e4                            # an outlier in one row only
    stored = INT8.encode(x)
    assert stored.dtype == torch.int8 and stored.shape == (*x.shape[:-1], 5)
    back = INT8.decode(stored)
    r = rotation(4, x.device)
    y, y_back = x @ r, back @ r                       # the rotated rows the codes quantize
    amax = y.abs().amax(-1, keepdim=True)
    step = scale_of(stored[..., 4:])
    slack = 2 ** (1e-3 / SCALE_STEPS)                 # a rounding error above a step keeps that step
    assert torch.all(step * slack >= amax / 127)
    assert torch.all(step <= amax / 127 * 2 ** (1 / SCALE_STEPS) + 2 ** -16)
    assert torch.all((y_back - y).abs() <= step * (0.5 + 127 * (slack - 1)) + amax * 1e-6)
    # In the model's coordinates: the rotation is orthogonal up to sqrt(b), so a row's
    # error is at most half a step times sqrt(d / b) in length.
    assert torch.all((back - x).norm(dim=-1, keepdim=True) <= step * 0.512 + amax * 1e-6)
    assert torch.equal(back[0, 0, 5], torch.zeros(1, 4))
    # The outlier coarsens its own row only: the row beside it keeps its own step.
    assert step[1, 1, 9].item() > 70 and step[1, 1, 8].item() < 1


def test_the_rotation_spreads_an_outlier_channel_so_the_other_channels_keep_their_precision():
    codec = make_codec("int8", torch.float32, 64)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2000, 64, generator=g) * 0.05
    x[:, 7] = 20.0 * torch.sign(torch.randn(2000, generator=g))   # a key's large channel, every row
    err = (codec.decode(codec.encode(x)) - x)[:, torch.arange(64) != 7]
    unrotated_rms = 20.0 / 127 / 12 ** 0.5           # one scale per row set by the outlier, no rotation
    assert err.pow(2).mean().sqrt().item() < unrotated_rms / 4


def test_exactly_representable_kv_round_trips_bit_exact():
    x = exact_kv_for(list(range(40)))
    assert torch.equal(INT8.decode(INT8.encode(x)), x)


def test_decoding_gives_the_same_bits_whatever_the_shape_or_destination():
    codec = make_codec("int8", torch.float32, 64)
    x = torch.randn(3, 2, 8, 3, 64, generator=torch.Generator().manual_seed(2)) * 3
    stored = codec.encode(x)
    whole = codec.decode(stored)
    rows = torch.cat([codec.decode(stored.reshape(-1, 65)[i:i + 1]) for i in range(stored.numel() // 65)])
    assert torch.equal(rows.view_as(whole), whole)
    hot = torch.zeros(4, 3, 2, 8, 3, 64)
    codec.copy_kv(hot[1, :, :, 2:7], stored[:, :, 2:7])   # a slot view: not contiguous
    assert torch.equal(hot[1, :, :, 2:7], whole[:, :, 2:7]) and not hot[1, :, :, :2].any()


def test_the_cpu_int8_matrix_product_decodes_the_same_bits_as_the_float_one(monkeypatch):
    import cluster.cache.codec as codec_module

    codec = make_codec("int8", torch.float32, 64)
    stored = codec.encode(torch.randn(2, 2, 16, 3, 64, generator=torch.Generator().manual_seed(4)) * 5)
    if not codec_module._int_mm_works():
        pytest.skip("this torch has no int8 matrix product on the CPU")
    fast = codec.decode(stored)
    monkeypatch.setattr(codec_module, "_INT_MM", [False])
    assert torch.equal(codec.decode(stored), fast)


def test_fp8_round_trip_error_is_within_its_mantissa():
    codec = make_codec("fp8", torch.float32, 4)
    x = kv(64, seed=1)
    stored = codec.encode(x)
    y, y_back = x @ rotation(4, x.device), codec.decode(stored) @ rotation(4, x.device)
    step = scale_of(stored[..., 4:])
    # e4m3: 3 mantissa bits (half a step is 1/16 of the value); subnormals below 2**-6.
    assert torch.all((y_back - y).abs() <= y.abs() / 16 + step * 2 ** -9 + y.abs().amax(-1, keepdim=True) * 1e-6)


def test_bfloat16_kv_decodes_to_bfloat16():
    codec = make_codec("int8", torch.bfloat16, 4)
    stored = INT8.encode(kv(8, seed=2))
    back = codec.decode(stored)
    assert back.dtype == torch.bfloat16 and torch.equal(back, INT8.decode(stored).to(torch.bfloat16))
    assert torch.equal(codec.encode(back), INT8.encode(back.float()))


def test_stored_bytes_are_a_quarter_of_float32_and_about_half_of_bfloat16():
    assert make_codec("int8", torch.float32, 64).stored_bytes_per_value_row() == 65
    assert make_codec("none", torch.float32, 64).stored_bytes_per_value_row() == 256
    assert make_codec("none", torch.bfloat16, 64).stored_bytes_per_value_row() == 128


# ------------------------------------------------------------- in the tiers
def test_warm_and_cold_hold_the_stored_bytes_and_promotion_restores_what_the_codec_decodes(tmp_path):
    c = cache(tmp_path)
    toks = list(range(10))
    x = kv(10, seed=3)
    tt.put(c, toks, kv=x)
    assert c.pools[WARM].tensor.dtype == torch.int8 and c.pools[WARM].tensor.shape[-1] == 5
    assert c.demote_path(toks, tier=WARM) == 10
    node = c.lookup(toks).last_node
    assert torch.equal(c.pools[WARM].read(node.extents), INT8.encode(x))
    assert c.demote_path(toks, tier=COLD) == 10
    node = c.lookup(toks).last_node
    disk = c.pools[COLD]
    assert disk.block_bytes == 2 * 2 * 4 * 1 * 5 and torch.equal(disk.read(node.extents), INT8.encode(x))
    m = tt.match(c, toks)
    assert m.tier_lengths == [0, 0, 10]
    assert torch.equal(m.kv, INT8.decode(INT8.encode(x)))
    c.close()


def test_the_disk_checksum_covers_the_stored_bytes(tmp_path):
    c = cache(tmp_path)
    toks = list(range(8))
    x = kv(8, seed=4)
    tt.put(c, toks, kv=x)
    c.demote_path(toks, tier=COLD)
    disk = c.pools[COLD]
    (b0, _, _), (b1, _, _) = c.lookup(toks).last_node.extents[0], c.lookup(toks).last_node.extents[1]
    for b, part in ((b0, x[:, :, :4]), (b1, x[:, :, 4:])):
        raw = bytearray(disk.block_bytes)
        import os
        os.preadv(disk._fd, [raw], b * disk.block_bytes)
        assert bytes(raw) == INT8.encode(part).contiguous().view(torch.uint8).numpy().tobytes()
        assert int(disk._sums[b]) == xxhash.xxh3_64_intdigest(bytes(raw))
    disk.corrupt_block_for_test(b1)
    m = tt.match(c, toks)                                 # the bad block and what hangs below it go
    assert c.stats["checksum_failures"] == 1 and m.length == 0
    c.close()


def test_mixed_formats_are_refused(tmp_path):
    c = cache(tmp_path)
    with pytest.raises(CodecMismatchError, match="not tier codec 'int8'"):
        c.pools[COLD].write([(0, 0, 4)], kv(4))           # model-dtype KV where stored bytes belong
    with pytest.raises(CodecMismatchError, match="not tier codec 'int8'"):
        INT8.check_stored(make_codec("none", torch.float32, 4).encode(kv(4)))
    with pytest.raises(CodecMismatchError, match="one codec for every tier"):
        c.attach_l3(L3Tier(MemoryL3Store(), LAYOUT, 4, L3TierConfig(model_id="m"), start_thread=False))
    with pytest.raises(CodecMismatchError):
        c.install(list(range(4)), None, torch.zeros(2, 2, 4, 1, 7, dtype=torch.int8))   # another row size
    c.close()
    plain = cache(tmp_path, codec="none")
    with pytest.raises(CodecMismatchError, match="one codec for every tier"):
        plain.attach_l3(L3Tier(MemoryL3Store(), LAYOUT, 4, L3TierConfig(model_id="m"), start_thread=False,
                               codec=INT8))
    plain.close()


def test_a_migrated_stored_block_is_installed_as_the_codec_decodes_it(tmp_path):
    c = cache(tmp_path)
    x = kv(8, seed=5)
    assert c.install(list(range(8)), None, INT8.encode(x)) == 8
    assert torch.equal(tt.match(c, list(range(8)) + [99]).kv, INT8.decode(INT8.encode(x)))
    c.close()


def test_conversions_run_on_the_copy_thread_never_the_callers(tmp_path, monkeypatch):
    threads = []
    for name in ("encode_into", "decode_into"):
        real = getattr(TierCodec, name)

        def spy(self, out, x, _real=real):
            threads.append(threading.current_thread().name)
            return _real(self, out, x)
        monkeypatch.setattr(TierCodec, name, spy)
    cfg = TierConfig(hot_blocks=8, warm_blocks=8, block_tokens=4, device="cpu", tier_codec="int8")
    c = TieredCache(cfg, LAYOUT, clock=TickClock())
    toks = list(range(12))
    tt.put(c, toks, kv=kv(12))
    c.demote_path(toks, tier=WARM)
    tt.match(c, toks)
    assert threads and all(t.startswith("kv-copy") for t in threads), threads
    c.close()


# ---------------------------------------------------------------------- L3
def test_the_l3_key_names_the_codec_and_its_format_version():
    assert FORMAT_VERSION == 2   # the rotated rows; version 1 (no rotation) had the same shape
    assert kv_layout_version(LAYOUT, 16) == "f1-L2-H1-D4-float32-B16"
    assert kv_layout_version(LAYOUT, 16, "int8") == "f1-L2-H1-D4-float32-B16-int8v2"
    assert kv_layout_version(LAYOUT, 16, "fp8") == "f1-L2-H1-D4-float32-B16-fp8v2"
    assert INT8.format_id == "int8v2" and make_codec("none", torch.float32, 4).format_id == "none"
    with pytest.raises(InvalidInputError, match="tier codec must be one of"):
        kv_layout_version(LAYOUT, 16, "int4")
    with pytest.raises(InvalidInputError, match="tier codec must be one of"):
        kv_layout_version(LAYOUT, 16, "int8v2")   # a codec's name, not a format's
    tier = L3Tier(MemoryL3Store(), LAYOUT, 4, L3TierConfig(model_id="m"), start_thread=False, codec=INT8)
    assert tier.key(0xAB).name == "pc/m/f1-L2-H1-D4-float32-B4-int8v2/00000000000000ab"


def test_a_value_stored_under_the_old_format_s_key_is_never_read():
    """Version 1's int8 bytes (the same shape, no rotation) sit under ``...-int8/``: a
    reader of version 2 looks only under ``...-int8v2/`` and finds nothing."""
    store = MemoryL3Store()
    b, tier_b = _l3_cache(store)
    toks = list(range(1, 9))
    h = block_hashes(toks, 4)
    old_key = l3_key("m", "f1-L2-H1-D4-float32-B4-int8", h[0])
    store.put_blocks([L3Block(old_key, tuple(toks[:4]), INT8.encode(kv(4)))])
    assert not b.ready(toks + [50]).ready
    tier_b.run_pending()
    assert b.apply_l3() == 0 and tier_b.stats.verify_failed_removed == 0 and store.num_values == 1
    b.close()


def _l3_cache(store, codec="int8"):
    cfg = TierConfig(hot_blocks=16, warm_blocks=16, block_tokens=4, device="cpu", tier_codec=codec)
    c = TieredCache(cfg, LAYOUT, clock=TickClock(), deterministic_io=True)
    tier = L3Tier(store, LAYOUT, 4, L3TierConfig(model_id="m", fetch="always", min_fetch_blocks=1),
                  start_thread=False, codec=c.codec)
    c.attach_l3(tier)
    return c, tier


def test_l3_values_hold_stored_bytes_and_a_fetch_restores_what_the_codec_decodes():
    store = MemoryL3Store()
    a, tier_a = _l3_cache(store)
    toks = list(range(1, 13))
    x = kv(12, seed=6)
    tt.put(a, toks, kv=x)                                 # the commit writes its 3 blocks behind
    tier_a.run_pending()
    a.apply_l3()
    hashes = block_hashes(toks, 4)
    lookups = [L3Lookup(tier_a.key(h), tuple(toks[i * 4:(i + 1) * 4])) for i, h in enumerate(hashes)]
    got = store.get_blocks(lookups)
    assert all(r.hit for r in got) and tier_a.stats.blocks_written == 3
    assert torch.equal(torch.cat([r.kv for r in got], dim=2), INT8.encode(x))
    b, tier_b = _l3_cache(store)
    assert not b.ready(toks + [50]).ready
    tier_b.run_pending()
    assert b.apply_l3() == 12
    m = tt.match(b, toks + [50])
    assert m.length == 12 and torch.equal(m.kv, INT8.decode(INT8.encode(x)))
    a.close()
    b.close()


def test_an_l3_write_of_hot_and_stored_parts_is_encoded_on_the_write_thread():
    store = MemoryL3Store()
    tier = L3Tier(store, LAYOUT, 4, L3TierConfig(model_id="m"), start_thread=False, codec=INT8)
    toks = list(range(1, 13))
    x = kv(12, seed=7)
    hashes = block_hashes(toks, 4)
    assert tier.write(toks, hashes, [0, 1, 2], [x[:, :, :6].clone(), INT8.encode(x[:, :, 6:])]) == 3
    assert store.num_values == 0                          # nothing encoded or stored on the caller's thread
    tier.run_pending()
    got = store.get_blocks([L3Lookup(tier.key(h), tuple(toks[i * 4:(i + 1) * 4])) for i, h in enumerate(hashes)])
    assert torch.equal(torch.cat([r.kv for r in got], dim=2), INT8.encode(x))


def test_an_l3_value_of_another_format_under_the_key_is_refused():
    store = MemoryL3Store()
    b, tier_b = _l3_cache(store)
    toks = list(range(1, 9))
    h = block_hashes(toks, 4)
    store.put_blocks([L3Block(tier_b.key(h[0]), tuple(toks[:4]), kv(4))])   # float32 bytes
    assert not b.ready(toks + [50]).ready
    tier_b.run_pending()
    assert b.apply_l3() == 0 and tier_b.stats.verify_failed_removed == 1
    assert store.num_values == 0
    b.close()


# ------------------------------------------------------------------- config
@pytest.mark.parametrize("kw, message", [
    ({"tier_codec": "int4"}, "tier_codec must be one of none, int8, fp8; got 'int4'"),
    ({"warm_mb": -1}, "warm_mb must be a positive number"),
    ({"warm_mb": "64"}, "warm_mb must be a positive number"),
    ({"warm_blocks": 8, "warm_mb": 1}, "give warm_blocks or warm_mb, not both"),
    ({"cold_mb": 4}, "cold_blocks needs warm_blocks"),
])
def test_bad_tier_config_is_refused_with_a_clear_message(kw, message):
    with pytest.raises(InvalidInputError, match=message.replace("(", r"\(")):
        TierConfig(hot_blocks=4, **kw)


def test_worker_config_takes_the_codec_and_byte_sizes():
    with pytest.raises(InvalidInputError, match="tier_codec must be one of"):
        WorkerConfig.from_dict({"tier_codec": "bogus"})
    w = WorkerConfig.from_dict({"tier_codec": "int8", "warm_mb": 64, "cold_mb": 128, "disk_dir": "/tmp"})
    assert (w.tiers.tier_codec, w.tiers.warm_mb, w.tiers.warm_blocks, w.tiers.cold_mb) == ("int8", 64, 0, 128)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for hosts without fp8 support")
def test_fp8_without_a_device_that_converts_it_is_refused():
    with pytest.raises(InvalidInputError, match="fp8 needs a CUDA device"):
        TieredCache(TierConfig(hot_blocks=4, warm_blocks=4, device="cpu", tier_codec="fp8"), LAYOUT)


def test_warm_mb_holds_four_times_the_blocks_of_float32_under_int8():
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64)   # the default model's KV
    blocks = {}
    for codec in ("none", "int8"):
        c = TieredCache(TierConfig(hot_blocks=2, warm_mb=64, block_tokens=16, device="cpu", tier_codec=codec),
                        layout)
        blocks[codec] = c.config.warm_blocks
        assert c.pools[WARM].block_bytes * blocks[codec] <= 64 << 20
        c.close()
    assert blocks == {"none": (64 << 20) // (30 * 2 * 16 * 3 * 64 * 4),
                      "int8": (64 << 20) // (30 * 2 * 16 * 3 * 65)}
    assert blocks["int8"] / blocks["none"] >= 3.9


# ----------------------------------------------- the tier tests again, under int8
TIER_TESTS = [n for n in dir(tt) if n.startswith("test_") and n not in (
    "test_bad_config_is_rejected", "test_cold_without_a_directory_lives_in_the_users_cache",
    "test_kv_memory_is_one_budget_split_by_the_cache_and_cold_is_on",   # int8 there already
    "test_bad_memory_budget_is_rejected_naming_the_key",
    "test_on_a_cpu_cache_warm_beside_a_memory_budget_is_an_error_naming_both", "test_simulation_mode_without_payload_moves_at_once",
    "test_a_prefetch_pushes_out_only_idle_prefixes_no_waiting_request_or_prefetch_touched",
    "test_ready_recomputes_only_where_the_measured_copy_is_slower_and_measures_again",
    "test_cuda_round_trip_through_pinned_host",
    "test_round_trip_hot_warm_cold_hot_is_bit_exact")]   # reads the pools' raw bytes: pinned above for int8
UPLOAD_TESTS = [n for n in dir(tsu) if n.startswith("test_a_") or n == "test_the_staging_buffers_are_allocated_once_and_reused"]


def _under_int8(monkeypatch, module):
    real = tt.make
    for m in {tt, module}:   # test_staged_upload calls test_tiered's put, which reads test_tiered's kv_for
        monkeypatch.setattr(m, "kv_for", exact_kv_for)
        monkeypatch.setattr(m, "make", lambda tmp_path, *a, **kw: real(tmp_path, *a, **{"tier_codec": "int8", **kw}))


@pytest.mark.parametrize("name", TIER_TESTS)
def test_tier_behaviour_under_int8(name, tmp_path, monkeypatch):
    """Each of test_tiered.py's tier tests with int8 lower tiers and KV the codec stores
    exactly, so their exact content checks hold as they are."""
    _under_int8(monkeypatch, tt)
    fn = getattr(tt, name)
    args = {"tmp_path": tmp_path, "monkeypatch": monkeypatch}
    fn(**{k: args[k] for k in fn.__code__.co_varnames[:fn.__code__.co_argcount]})


@pytest.mark.parametrize("name", UPLOAD_TESTS)
@pytest.mark.parametrize("chunk_blocks", [1, 3])
def test_staged_upload_under_int8(name, chunk_blocks, tmp_path, monkeypatch):
    _under_int8(monkeypatch, tsu)
    fn = getattr(tsu, name)
    args = {"tmp_path": tmp_path, "monkeypatch": monkeypatch, "chunk_blocks": chunk_blocks}
    fn(**{k: args[k] for k in fn.__code__.co_varnames[:fn.__code__.co_argcount]})


# --------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip_through_pinned_int8_warm_matches_the_cpu_codec(tmp_path):
    cfg = TierConfig(hot_blocks=8, warm_blocks=8, cold_blocks=8, block_tokens=4, device="cuda",
                     disk_dir=str(tmp_path), tier_codec="int8")
    c = TieredCache(cfg, LAYOUT, clock=TickClock())
    toks = list(range(10))
    x = kv(10, seed=9)
    tt.put(c, toks, kv=x.cuda())
    c.demote_path(toks, tier=WARM)
    node = c.lookup(toks).last_node
    assert c.pools[WARM].tensor.is_pinned()
    stored = INT8.encode(x.cuda()).cpu()                  # encoded on the device, as the copy stream does
    assert torch.equal(c.pools[WARM].read(node.extents), stored)
    m = tt.match(c, toks)
    assert torch.equal(m.kv.cpu(), INT8.decode(stored.cuda()).cpu())
    c.demote_path(toks, tier=COLD)
    m = tt.match(c, toks)
    assert m.tier_lengths == [0, 0, 10] and torch.equal(m.kv.cpu(), INT8.decode(stored.cuda()).cpu())
    c.close()


# ------------------------------------- the tiered state machine again, under int8
def exact_kv_of(tokens):
    """test_tiered_state_machine's KV, made of rows the int8 codec stores exactly (what it
    decodes from codes [127, q] at scale code e), still distinct per prefix."""
    q, code = [], []
    for i in range(len(tokens)):
        h = hash(tuple(tokens[:i + 1]))
        q.append([127, (h // 13) % 255 - 127])
        code.append([8 * (h % 13 - 6)])
    stored = stored_rows(torch.tensor(q).view(1, 1, -1, 1, 2), torch.tensor(code).view(1, 1, -1, 1, 1))
    x = make_codec("int8", torch.float32, 2).decode(stored)
    return x.expand(1, 2, -1, 1, 2).contiguous()


def test_the_tiered_state_machine_under_int8(monkeypatch):
    import dataclasses

    from hypothesis import settings
    from hypothesis.stateful import run_state_machine_as_test

    import tests.unit.test_tiered_state_machine as tsm

    class Int8Machine(tsm.TieredMachine):
        def __init__(self):
            super().__init__()
            self.cache.close()
            cfg = dataclasses.replace(self.cache.config, tier_codec="int8")
            self.cache = TieredCache(cfg, tsm.LAYOUT, deterministic_io=True)
            assert self.cache.pools[WARM].tensor.dtype == torch.int8

    monkeypatch.setattr(tsm, "kv_of", exact_kv_of)
    run_state_machine_as_test(Int8Machine, settings=settings(max_examples=25, stateful_step_count=30,
                                                             deadline=None))
