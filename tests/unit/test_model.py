"""DecoderModel: config validation, determinism, prefix-split exactness, packing, sampling."""

from __future__ import annotations

import pytest
import torch

import cluster.engine.model as model_module
from cluster.engine import attention, linear_layouts
from cluster.engine.model import (
    CausalLM,
    DecoderModel,
    ModelConfig,
    kv_shape,
)
from cluster.engine.sampling import sample
from cluster.engine.tokenizer import ByteTokenizer
from tests.requirements import KERNELS, require
from tests.unit.reference_forward import ReferenceForward, forward_batch, forward_one

SMALL = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    intermediate_size=128, max_position=512, seed=7)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model() -> DecoderModel:
    return DecoderModel(SMALL)


def tokens_of(length: int, seed: int = 0, vocab: int = SMALL.vocab_size) -> torch.Tensor:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))


# ---- config -------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"vocab_size": 0}, "vocab_size"),
        ({"hidden_size": -1}, "hidden_size"),
        ({"num_layers": 0}, "num_layers"),
        ({"num_heads": 2.0}, "num_heads"),
        ({"num_kv_heads": True}, "num_kv_heads"),
        ({"num_heads": 8, "num_kv_heads": 3}, "num_heads"),
        ({"head_dim": 33}, "head_dim"),
        ({"intermediate_size": 0}, "intermediate_size"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
        ({"max_position": 0}, "max_position"),
        ({"seed": -1}, "seed"),
        ({"dtype": "float64"}, "dtype"),
        ({"qkv_bias": 1}, "qkv_bias"),
        ({"rope_type": "yarn"}, "rope_type"),
        ({"rope_factor": 0.0}, "rope_factor"),
        ({"rope_type": "llama3", "rope_low_freq_factor": 4.0}, "rope_high_freq_factor"),
        ({"rope_original_max_position": 0}, "rope_original_max_position"),
    ],
)
def test_config_rejects_bad_field_and_names_it(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}\b"):
        ModelConfig(**overrides)


def test_default_config_matches_byte_tokenizer_and_allows_explicit_head_dim() -> None:
    config = ModelConfig()
    assert config.vocab_size == ByteTokenizer.vocab_size == 259
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (4, 8, 2, 32)
    # head_dim need not equal hidden_size / num_heads (as in Llama's config).
    wide = DecoderModel(ModelConfig(hidden_size=48, num_heads=4, num_kv_heads=1, head_dim=16,
                                    num_layers=1, intermediate_size=64, max_position=64))
    logits, kv = forward_one(wide, tokens_of(5), 0, None)
    assert logits.shape == (5, 259) and kv.shape == (1, 2, 5, 1, 16)


def test_model_satisfies_causal_lm_protocol(model: DecoderModel) -> None:
    # One forward on the model (forward_paged); the CausalLM methods are the tests' reference adapter.
    assert not hasattr(model, "forward_one") and not hasattr(model, "forward_batch")
    assert isinstance(ReferenceForward(model), CausalLM)
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())


# ---- determinism --------------------------------------------------------------------------------

def test_same_seed_same_logits_different_seed_differs(model: DecoderModel) -> None:
    tokens = tokens_of(24)
    logits, kv = forward_one(model, tokens, 0, None)
    again_logits, again_kv = forward_one(DecoderModel(SMALL), tokens, 0, None)
    assert torch.equal(logits, again_logits) and torch.equal(kv, again_kv)
    other = DecoderModel(ModelConfig(**{**SMALL.__dict__, "seed": 8}))
    assert (forward_one(other, tokens, 0, None)[0] - logits).abs().max() > 1e-3


def test_construction_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    DecoderModel(SMALL)
    assert torch.equal(torch.rand(3), expected)


def test_output_shapes_and_logits_are_well_behaved(model: DecoderModel) -> None:
    logits, kv = forward_one(model, tokens_of(10), 0, None)
    assert logits.shape == (10, SMALL.vocab_size) and logits.dtype == torch.float32
    assert kv.shape == kv_shape(SMALL, 10) == (2, 2, 10, 2, 16)
    assert torch.isfinite(logits).all() and logits.abs().max() < 10


def test_bfloat16_model_keeps_kv_in_bfloat16_and_logits_in_float32(model: DecoderModel) -> None:
    half = DecoderModel(ModelConfig(**{**SMALL.__dict__, "dtype": "bfloat16"}))
    tokens = tokens_of(30, seed=2)
    logits, kv = forward_one(half, tokens, 0, None)
    assert kv.dtype == torch.bfloat16 and logits.dtype == torch.float32
    assert half.rope_cos.dtype == torch.float32
    torch.testing.assert_close(logits, forward_one(model, tokens, 0, None)[0], atol=2e-2, rtol=0)
    suffix_logits, _ = forward_one(half, tokens[10:], 10, kv[:, :, :10])
    torch.testing.assert_close(suffix_logits, logits[10:], atol=1e-2, rtol=0)


# ---- prefix-split exactness ---------------------------------------------------------------------

@pytest.mark.parametrize("split", [0, 1, 7, 16, 31, 47, 48])
def test_prefill_with_cached_prefix_equals_full_prefill(model: DecoderModel, split: int) -> None:
    tokens = tokens_of(49, seed=3)
    full_logits, full_kv = forward_one(model, tokens, 0, None)
    prefix_kv = forward_one(model, tokens[:split], 0, None)[1] if split else None
    logits, kv = forward_one(model, tokens[split:], split, prefix_kv)
    assert logits.shape == (49 - split, SMALL.vocab_size)
    torch.testing.assert_close(logits, full_logits[split:], atol=1e-4, rtol=0)
    torch.testing.assert_close(kv, full_kv[:, :, split:], atol=1e-4, rtol=0)


@pytest.mark.parametrize(("new", "past"), [(2, 1), (5, 30), (40, 11), (300, 700)])
def test_attention_after_a_cached_prefix_equals_one_masked_softmax(new: int, past: int) -> None:
    # On the CPU the queries after a cached prefix attend the prefix and their own keys in two
    # flash calls merged through their log-sum-exps; that is one causal softmax over all keys.
    config = ModelConfig(num_heads=6, num_kv_heads=2, head_dim=16)
    gen = torch.Generator().manual_seed(new + past)
    q = torch.randn(new, 6, 16, generator=gen)
    keys, values = (torch.randn(2, past + new, 16, generator=gen) for _ in range(2))
    got = attention.attend_torch(config, q, keys, values, past)
    visible = torch.arange(past + new)[None, :] <= torch.arange(past, past + new)[:, None]
    scores = torch.einsum("thd,hsd->hts", q, keys.repeat_interleave(3, 0)) * 16 ** -0.5
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    expected = torch.einsum("hts,hsd->thd", probs, values.repeat_interleave(3, 0))
    assert got.shape == (new, 6, 16)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_token_by_token_decode_equals_full_prefill(model: DecoderModel) -> None:
    tokens = tokens_of(20, seed=4)
    full_logits, full_kv = forward_one(model, tokens, 0, None)
    kv = forward_one(model, tokens[:1], 0, None)[1]
    for pos in range(1, 20):
        logits, new_kv = forward_one(model, tokens[pos:pos + 1], pos, kv)
        torch.testing.assert_close(logits[0], full_logits[pos], atol=1e-4, rtol=0)
        kv = torch.cat((kv, new_kv), dim=2)
    torch.testing.assert_close(kv, full_kv, atol=1e-4, rtol=0)


def test_position_matters(model: DecoderModel) -> None:
    # Same tokens after two different prefixes of equal length: K differs only through the past,
    # so the first layer's K must be identical and later outputs must differ.
    suffix = tokens_of(5, seed=5)
    kv_a = forward_one(model, tokens_of(8, seed=6), 0, None)[1]
    kv_b = forward_one(model, tokens_of(8, seed=9), 0, None)[1]
    logits_a, new_a = forward_one(model, suffix, 8, kv_a)
    logits_b, new_b = forward_one(model, suffix, 8, kv_b)
    torch.testing.assert_close(new_a[0], new_b[0], atol=0, rtol=0)
    assert (logits_a - logits_b).abs().max() > 1e-4


# ---- packed batches -----------------------------------------------------------------------------

def test_forward_batch_equals_forward_one_per_item(model: DecoderModel) -> None:
    history = tokens_of(60, seed=10)
    history_kv = forward_one(model, history, 0, None)[1]
    items = [
        (tokens_of(17, seed=11), 0, None),
        (history[25:40], 25, history_kv[:, :, :25]),
        (tokens_of(1, seed=12), 60, history_kv),
        (tokens_of(3, seed=13), 0, None),
        (history[59:], 59, history_kv[:, :, :59].clone()),
    ]
    batched = forward_batch(model, items)
    assert len(batched) == len(items)
    for (tokens, _, _), (logits, kv), item in zip(items, batched, items):
        one_logits, one_kv = forward_one(model, *item)
        assert logits.shape == (tokens.numel(), SMALL.vocab_size)
        torch.testing.assert_close(logits, one_logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(kv, one_kv, atol=1e-5, rtol=0)
    assert forward_batch(model, []) == []


def test_last_logits_only_gives_each_items_last_row(model: DecoderModel) -> None:
    history = tokens_of(30, seed=14)
    history_kv = forward_one(model, history, 0, None)[1]
    items = [(tokens_of(9, seed=15), 0, None), (history[20:], 20, history_kv[:, :, :20]),
             (tokens_of(1, seed=16), 30, history_kv)]
    full = forward_batch(model, items)
    last = forward_batch(model, items, last_logits_only=True)
    for (logits, kv), (last_logits, last_kv) in zip(full, last):
        assert last_logits.shape == (1, SMALL.vocab_size)
        torch.testing.assert_close(last_logits, logits[-1:], atol=1e-5, rtol=0)
        assert torch.equal(kv, last_kv)
    one_logits, _ = forward_one(model, history, last_logits_only=True)
    torch.testing.assert_close(one_logits, full_logits_of(model, history)[-1:], atol=1e-5, rtol=0)


def full_logits_of(model: DecoderModel, tokens: torch.Tensor) -> torch.Tensor:
    return forward_one(model, tokens, 0, None)[0]


VARIANT = ModelConfig(**{**SMALL.__dict__, "head_dim": 24, "tie_word_embeddings": True, "qkv_bias": True,
                         "o_bias": True, "mlp_bias": True, "qk_norm": True, "rope_type": "llama3",
                         "rope_factor": 8.0, "rope_original_max_position": 32})


@pytest.mark.parametrize("split", [1, 13, 39])
def test_every_variant_flag_keeps_prefix_splits_exact(split: int) -> None:
    variant = DecoderModel(VARIANT)
    assert variant.lm_head is None and variant.output_weight is variant.embed
    assert variant.layers[0].qk_norm.shape == (SMALL.num_heads + SMALL.num_kv_heads, 24)
    tokens = tokens_of(40, seed=17)
    full_logits, full_kv = forward_one(variant, tokens, 0, None)
    logits, kv = forward_one(variant, tokens[split:], split, full_kv[:, :, :split])
    torch.testing.assert_close(logits, full_logits[split:], atol=1e-4, rtol=0)
    torch.testing.assert_close(kv, full_kv[:, :, split:], atol=1e-4, rtol=0)


def test_rope_scaling_follows_transformers_formulas() -> None:
    base = model_module.rope_inv_freq(ModelConfig(head_dim=64))
    linear = model_module.rope_inv_freq(ModelConfig(head_dim=64, rope_type="linear", rope_factor=4.0))
    torch.testing.assert_close(linear, base / 4.0)
    llama3 = model_module.rope_inv_freq(ModelConfig(head_dim=64, rope_theta=500000.0, rope_type="llama3",
                                                    rope_factor=8.0, rope_original_max_position=8192))
    plain = model_module.rope_inv_freq(ModelConfig(head_dim=64, rope_theta=500000.0))
    wavelen = 2 * torch.pi / plain
    assert torch.equal(llama3[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])    # high frequencies kept
    torch.testing.assert_close(llama3[wavelen > 8192], plain[wavelen > 8192] / 8)  # low ones slowed
    # The default tables are float64-accurate; rope_in_float32 reproduces transformers' float32 angles.
    hf_like = DecoderModel(ModelConfig(**{**SMALL.__dict__, "rope_in_float32": True}))
    assert 0 < (hf_like.rope_cos - DecoderModel(SMALL).rope_cos).abs().max() < 1e-3


# ---- input validation ---------------------------------------------------------------------------

def test_forward_rejects_bad_inputs(model: DecoderModel) -> None:
    tokens = tokens_of(4)
    kv = forward_one(model, tokens, 0, None)[1]
    with pytest.raises(TypeError, match="1-D integer tensor"):
        forward_one(model, tokens.float(), 0, None)
    with pytest.raises(TypeError, match="1-D integer tensor"):
        forward_one(model, tokens.view(2, 2), 0, None)
    with pytest.raises(ValueError, match="must not be empty"):
        forward_one(model, tokens[:0], 0, None)
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, 259\)"):
        forward_one(model, torch.tensor([1, 259]), 0, None)
    with pytest.raises(ValueError, match="start_pos must be a non-negative int"):
        forward_one(model, tokens, -1, None)
    with pytest.raises(ValueError, match="past_kv is None but start_pos is 4"):
        forward_one(model, tokens, 4, None)
    with pytest.raises(ValueError, match=r"past_kv must have shape \(2, 2, 3, 2, 16\)"):
        forward_one(model, tokens, 3, kv)
    with pytest.raises(ValueError, match="past_kv dtype"):
        forward_one(model, tokens, 4, kv.double())
    with pytest.raises(ValueError, match="exceeds max_position 512"):
        forward_one(model, tokens, 510, torch.zeros(kv_shape(SMALL, 510)))
    with pytest.raises(ValueError, match=r"items\[1\]: start_pos"):
        forward_batch(model, [(tokens, 0, None), (tokens, -2, None)])
    with pytest.raises(TypeError, match=r"items\[0\] must be a \(tokens, start_pos, past_kv\) tuple"):
        forward_batch(model, [tokens])


# ---- sampling -----------------------------------------------------------------------------------

def test_greedy_is_argmax_and_tiny_top_p_is_argmax() -> None:
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9, 0.0])
    assert sample(logits, 0.0) == 1
    generator = torch.Generator().manual_seed(0)
    assert all(sample(logits, 1.0, 1e-6, generator) == 1 for _ in range(50))
    # top_p below float32's range (found by the HTTP fuzz suite): still the most likely token
    for tiny in (1e-300, 2.2250738585072014e-308, 5e-324):
        assert sample(logits, 1.0, tiny, generator) == 1


def test_seeded_sampling_is_reproducible_and_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))

    def draws(seed: int, top_p: float, n: int = 400) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return [sample(logits, 1.0, top_p, generator) for _ in range(n)]

    first = draws(42, 1.0)
    assert first == draws(42, 1.0)
    assert first != draws(43, 1.0)
    assert set(first) == {0, 1, 2, 3}
    # top_p = 0.8: tokens 0 and 1 reach it (0.5 + 0.3), so 2 and 3 are never drawn.
    assert set(draws(42, 0.8)) == {0, 1}
    # Token 0 alone reaches 0.4; 0.6 needs tokens 0 and 1.
    assert set(draws(1, 0.4)) == {0}
    assert set(draws(1, 0.6)) == {0, 1}
    # Low temperature sharpens towards the argmax.
    generator = torch.Generator().manual_seed(0)
    assert all(sample(logits, 0.01, 1.0, generator) == 0 for _ in range(50))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"logits_row": torch.zeros(2, 3)}, "logits_row"),
        ({"logits_row": torch.tensor([]).float()}, "logits_row"),
        ({"logits_row": torch.tensor([0.0, float("nan")])}, "NaN"),
    ],
)
def test_sample_rejects_bad_parameters(kwargs: dict, message: str) -> None:
    arguments = {"logits_row": torch.zeros(4), "temperature": 1.0, "top_p": 0.9, **kwargs}
    with pytest.raises(ValueError, match=message):
        sample(**arguments)


POOL_BLOCK_TOKENS = 16


def _in_pool(buffers: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """Head-major KV ``buffers`` [layers, 2, kv_heads, n, head_dim] laid into a slotted pool
    [blocks, layers, 2, block_tokens, kv_heads, head_dim] at scattered slots (junk elsewhere):
    the pool, each buffer's slot table, and where each table starts in their concatenation."""
    layers, _, kv_heads, _, head_dim = buffers[0].shape
    total = sum(b.shape[3] for b in buffers)
    blocks = -(-total // POOL_BLOCK_TOKENS) + 2
    g = torch.Generator().manual_seed(total)
    pool = torch.randn(blocks, layers, 2, POOL_BLOCK_TOKENS, kv_heads, head_dim, generator=g)
    order = torch.randperm(blocks * POOL_BLOCK_TOKENS, generator=g)
    tables, starts = [], [0]
    for buf in buffers:
        slots = order[starts[-1]:starts[-1] + buf.shape[3]]
        pool[slots // POOL_BLOCK_TOKENS, :, :, slots % POOL_BLOCK_TOKENS] = buf.permute(3, 0, 1, 2, 4)
        tables.append(slots)
        starts.append(starts[-1] + slots.numel())
    return pool, tables, starts


def _at(pool: torch.Tensor, slots: torch.Tensor, layer: int, kv: int) -> torch.Tensor:
    """The K (kv 0) or V (1) rows of ``layer`` at ``slots``: [len(slots), kv_heads, head_dim]."""
    return pool[slots // POOL_BLOCK_TOKENS, layer, kv, slots % POOL_BLOCK_TOKENS]


def test_decode_kernel_equals_the_torch_path_at_every_length_on_the_vector_path():
    """head_dim 64 takes the kernel's AVX2 path (vector dot products, vector exp in the
    softmax); context lengths below, at and around multiples of 8 cover its tails. Each
    sequence's keys are read through its slot table in a pool, scattered over its blocks."""
    cfg = ModelConfig(num_layers=2, hidden_size=192, num_heads=3, num_kv_heads=1, head_dim=64,
                      intermediate_size=128, seed=4)
    model = DecoderModel(cfg)
    require(KERNELS, model.use_decode_kernel(True), "the decode kernel could not be built here")
    g = torch.Generator().manual_seed(2)
    lengths = [1, 2, 7, 8, 9, 16, 23, 300]
    buffers = [torch.randn(cfg.num_layers, 2, 1, n + 1, 64, generator=g) * 3 for n in lengths]
    q = torch.randn(len(lengths), 3, 64, generator=g) * 3
    k_new = torch.randn(len(lengths), 1, 64, generator=g)
    v_new = torch.randn(len(lengths), 1, 64, generator=g)
    want = []
    for b, n in enumerate(lengths):
        keys = torch.cat([buffers[b][1, 0, :, :n], k_new[b, :, None]], dim=1)
        values = torch.cat([buffers[b][1, 1, :, :n], v_new[b, :, None]], dim=1)
        want.append(attention.attend_torch(cfg, q[b:b + 1], keys, values, n)[0])
    pool, tables, starts = _in_pool(buffers)
    got = model.kernels.attention(q, k_new, v_new, pool, 1, torch.cat(tables), starts, lengths, [1] * len(lengths),
                              64 ** -0.5)
    # Outputs of magnitude ~10: float32 sums of 300 terms in another order differ by
    # up to about 1e-5 relative (seen: 1.3e-5 absolute on an output of 1.4).
    torch.testing.assert_close(got, torch.stack(want), atol=1e-5, rtol=2e-5)
    for b, n in enumerate(lengths):   # the new token's K/V went into its slot, in place
        new = tables[b][n:n + 1]
        assert torch.equal(_at(pool, new, 1, 0), k_new[b:b + 1]) and torch.equal(_at(pool, new, 1, 1), v_new[b:b + 1])


def test_paged_kernel_attends_each_new_token_causally_like_the_torch_path():
    """A few new tokens per sequence after its prefix (1, 3, 8, 17 and 128 of them, after
    prefixes of 1 to 300): each attends its sequence's keys up to its own position, as the
    SDPA path with its mask; every new token's K/V lands at its slot in the pool, in place."""
    cfg = ModelConfig(num_layers=2, hidden_size=192, num_heads=3, num_kv_heads=1, head_dim=64,
                      intermediate_size=128, seed=4)
    model = DecoderModel(cfg)
    require(KERNELS, model.use_decode_kernel(True) and model.kernels.attention is not None,
            "the attention kernels could not be built here")
    g = torch.Generator().manual_seed(5)
    starts, counts = [1, 7, 8, 23, 300], [3, 1, 17, 128, 8]
    buffers = [torch.randn(cfg.num_layers, 2, 1, s + n, 64, generator=g) * 3 for s, n in zip(starts, counts)]
    total = sum(counts)
    q = torch.randn(total, 3, 64, generator=g) * 3
    k_new = torch.randn(total, 1, 64, generator=g)
    v_new = torch.randn(total, 1, 64, generator=g)
    want, offset = [], 0
    for b, (s, n) in enumerate(zip(starts, counts)):
        rows = slice(offset, offset + n)
        keys = torch.cat([buffers[b][1, 0, :, :s], k_new[rows].transpose(0, 1)], dim=1)
        values = torch.cat([buffers[b][1, 1, :, :s], v_new[rows].transpose(0, 1)], dim=1)
        want.append(attention.attend_torch(cfg, q[rows], keys, values, s))
        offset += n
    pool, tables, table_starts = _in_pool(buffers)
    slots = torch.cat(tables)
    got = model.kernels.attention(q, k_new, v_new, pool, 1, slots, table_starts, starts, counts, 64 ** -0.5)
    # As for the decode kernel: float32 sums of up to 428 terms in another order (seen: 1.2e-5
    # absolute, 2 outputs of 30,144 past 1e-5).
    torch.testing.assert_close(got, torch.cat(want), atol=3e-5, rtol=3e-5)
    offset = 0
    for b, (s, n) in enumerate(zip(starts, counts)):
        assert torch.equal(_at(pool, tables[b][s:], 1, 0), k_new[offset:offset + n])
        assert torch.equal(_at(pool, tables[b][s:], 1, 1), v_new[offset:offset + n])
        offset += n
    with pytest.raises(RuntimeError, match="counts add up to"):
        model.kernels.attention(q[:5], k_new[:5], v_new[:5], pool, 1, slots, table_starts, starts, counts, 64 ** -0.5)


def _linears(model: DecoderModel) -> list[torch.Tensor]:
    return [w for layer in model.layers for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                                   layer.down_proj)] + [model.output_weight]


def test_every_linear_layout_gives_the_same_logits_at_every_row_count() -> None:
    """``tune_linears`` may pick any layout per row count, for the layers and the head
    apart: the packed forward's logits and KV agree between them within float32 rounding."""
    model = DecoderModel(SMALL)
    items = [(tokens_of(1 + i % 3, seed=i), 0, None) for i in range(40)]   # 1..64 rows packed
    layouts = [linear_layouts.PLAIN, linear_layouts.TRANSPOSED]
    if linear_layouts.packed_available():
        layouts.append(linear_layouts.PACKED)
        model.kernels.packed = {(linear_layouts.PACKED, id(w)): linear_layouts.pack(w) for w in _linears(model)}
    order = linear_layouts.blocked_order([(w, None) for w in _linears(model)])
    if order is not None:
        layouts.append(linear_layouts.BLOCKED)
        model.kernels.packed.update(((linear_layouts.BLOCKED, id(w)), linear_layouts.panels(w, order))
                             for w in _linears(model))
    for rows in (1, 2, 5, 16, 40):
        outs = []
        for layer_layout in layouts:
            for head_layout in layouts:
                model.kernels.layer_layouts = (0,) + (layer_layout,) * 64
                model.kernels.head_layouts = (0,) + (head_layout,) * 64
                outs.append(forward_batch(model, items[:rows]))
        for other in outs[1:]:
            for (la, ka), (lb, kb) in zip(outs[0], other):
                torch.testing.assert_close(la, lb, atol=1e-5, rtol=0)
                torch.testing.assert_close(ka, kb, atol=1e-5, rtol=0)


def test_tuned_layouts_cover_every_row_count_and_are_measured_once_a_machine(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(linear_layouts.TUNING_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(linear_layouts, "_known", {})
    model = DecoderModel(SMALL)
    tuned = model.tune_linears()
    assert sorted(tuned) == ["head", "layers"]
    for group, layouts in (("layers", model.kernels.layer_layouts), ("head", model.kernels.head_layouts)):
        assert sorted(tuned[group]) == list(linear_layouts.TUNED_ROWS)
        assert set(tuned[group].values()) <= set(linear_layouts.NAMES.values())
        # Row counts between two measured ones take the layout of the one below; beyond the last, the last's.
        assert linear_layouts.NAMES[linear_layouts.layout_for(layouts, 3)] == tuned[group][2]
        assert linear_layouts.NAMES[linear_layouts.layout_for(layouts, 63)] == tuned[group][32]
        assert linear_layouts.NAMES[linear_layouts.layout_for(layouts, 127)] == tuned[group][96]
        assert linear_layouts.NAMES[linear_layouts.layout_for(layouts, 129)] == tuned[group][128]
        last = linear_layouts.TUNED_ROWS[-1]
        assert linear_layouts.NAMES[linear_layouts.layout_for(layouts, 4096)] == tuned[group][last]
    # A group some row count runs packed has its weights packed; the others none.
    packed_layers = linear_layouts.PACKED in model.kernels.layer_layouts
    assert ((linear_layouts.PACKED, id(model.layers[0].qkv_proj)) in model.kernels.packed) == packed_layers
    assert ((linear_layouts.PACKED, id(model.output_weight)) in model.kernels.packed) == \
        (linear_layouts.PACKED in model.kernels.head_layouts)
    for group, weight in ((model.kernels.layer_layouts, model.layers[-1].down_proj), (model.kernels.head_layouts,
                                                                                model.output_weight)):
        assert ((linear_layouts.BLOCKED, id(weight)) in model.kernels.packed) == (linear_layouts.BLOCKED in group)
    assert (tmp_path / "linear-layouts.json").is_file()

    # Another process on this machine (an empty in-process table) reads the file instead of measuring.
    monkeypatch.setattr(linear_layouts, "_known", {})

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(linear_layouts, "_time", no_measuring)
    assert DecoderModel(SMALL).tune_linears() == tuned
    # A damaged file is measured over, not trusted.
    (tmp_path / "linear-layouts.json").write_text("{not json")
    monkeypatch.setattr(linear_layouts, "_known", {})
    with pytest.raises(AssertionError, match="measured again"):
        DecoderModel(SMALL).tune_linears()


@pytest.mark.parametrize("opt_in", [None, "1"])
def test_packed_layout_is_picked_only_when_asked_for(monkeypatch, tmp_path, opt_in) -> None:
    """MKL's packed sgemm sums in another order than transformers' forward, so ``tuned``
    considers it only with ``PREFIX_CACHE_MKL_PACKED=1``; then, where it is the fastest,
    the group runs packed and its weights have packed copies."""
    if not linear_layouts.packed_available():
        pytest.skip("torch without MKL's packed sgemm")
    monkeypatch.setenv(linear_layouts.TUNING_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(linear_layouts, "_known", {})
    if opt_in is None:
        monkeypatch.delenv(linear_layouts.PACKED_ENV, raising=False)
    else:
        monkeypatch.setenv(linear_layouts.PACKED_ENV, opt_in)
    # A machine where packed always wins, then transposed, then blocked, then plain.
    rank = {linear_layouts.PACKED: 0, linear_layouts.TRANSPOSED: 1, linear_layouts.BLOCKED: 2,
            linear_layouts.PLAIN: 3}
    monkeypatch.setattr(linear_layouts, "_time", lambda weights, rows, layout, packs, **_: rank[layout])
    model = DecoderModel(SMALL)
    tuned = model.tune_linears()
    expected = "packed" if opt_in == "1" else "W @ x^T"
    assert set(tuned["layers"].values()) == set(tuned["head"].values()) == {expected}
    assert sum(key[0] == linear_layouts.PACKED for key in model.kernels.packed) == \
        (4 * SMALL.num_layers + 1 if opt_in == "1" else 0)
    logits = forward_batch(model, [(tokens_of(1, seed=s), 0, None) for s in range(4)])
    monkeypatch.setattr(model.kernels, "layer_layouts", None)
    monkeypatch.setattr(model.kernels, "head_layouts", None)
    model.kernels.packed = {}
    for (la, _), (lb, _) in zip(logits, forward_batch(model, [(tokens_of(1, seed=s), 0, None) for s in range(4)])):
        torch.testing.assert_close(la, lb, atol=1e-5, rtol=0)


def test_the_packed_opt_in_travels_to_replicas_as_set_where_the_app_is_built() -> None:
    assert linear_layouts.worker_env({}) == {}
    assert linear_layouts.worker_env({"PREFIX_CACHE_MKL_PACKED": "1"}) == {"PREFIX_CACHE_MKL_PACKED": "1"}
    assert linear_layouts.worker_env({"PREFIX_CACHE_MKL_PACKED": "0"}) == {"PREFIX_CACHE_MKL_PACKED": "0"}
