"""The compiled norm and rotary embedding of the packed decoder (``decode_attention.cpp``:
``rms_norm``, ``rope``) against the torch path they replace on the CPU."""

import pytest
import torch

from cluster.engine import kernels
from cluster.engine.model import DecoderModel, ModelConfig, _apply_rope, _rms_norm
from tests.unit.helpers import require_compiled
from tests.unit.reference_forward import forward_one

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ops():
    return require_compiled(kernels.small_ops(), "decode_attention")


def _qk_view(rows: int, heads: int, head_dim: int, extra_heads: int = 3) -> torch.Tensor:
    """q and k columns of a fused qkv output: rows strided past the v columns."""
    g = torch.Generator().manual_seed(rows * 31 + heads)
    qkv = torch.randn(rows, (heads + extra_heads) * head_dim, generator=g) * 3
    return qkv[:, :heads * head_dim].view(rows, heads, head_dim)


@pytest.mark.parametrize("shape", [(8, 576), (1000, 576), (3, 100), (1, 7)])
def test_rms_norm_equals_the_torch_path(ops, shape):
    g = torch.Generator().manual_seed(shape[0])
    x, weight = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    want, got = _rms_norm(x, weight, 1e-5), ops.rms_norm(x, weight, 1e-5)
    assert got.shape == want.shape and got.is_contiguous()
    # Only the order of the sum of squares differs: a few float32 ulps.
    assert ((got - want).abs() / want.abs().max()).max().item() < 1e-6


@pytest.mark.parametrize("weight_shape", [(64,), (4, 64)], ids=["shared", "per-head"])
def test_rms_norm_of_strided_heads_normalizes_each_head(ops, weight_shape):
    x, weight = _qk_view(5, 4, 64), torch.randn(*weight_shape)
    want, got = _rms_norm(x, weight, 1e-6), ops.rms_norm(x, weight, 1e-6)
    assert ((got - want).abs() / want.abs().max()).max().item() < 1e-6


@pytest.mark.parametrize("rows, heads", [(1, 12), (8, 12), (300, 4)])
def test_rope_is_the_torch_path_bit_for_bit(ops, rows, heads):
    g = torch.Generator().manual_seed(rows)
    cos, sin = torch.randn(rows, 1, 64, generator=g), torch.randn(rows, 1, 64, generator=g)
    for x in (_qk_view(rows, heads, 64), _qk_view(rows, heads, 64).contiguous()):
        assert torch.equal(ops.rope(x, cos, sin), _apply_rope(x, cos, sin))


def test_the_ops_refuse_what_they_do_not_compute(ops):
    with pytest.raises(RuntimeError, match="float32 only"):
        ops.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match="weight must be \\[8\\] or x's trailing dimensions"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(9), 1e-5)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.randn(2, 3, 8), torch.randn(2, 8), 1e-5)
    with pytest.raises(RuntimeError, match="head_dim must be even"):
        ops.rope(torch.randn(2, 3, 7), torch.randn(2, 1, 7), torch.randn(2, 1, 7))


def test_a_model_with_the_compiled_ops_gives_the_torch_paths_logits(ops):
    cfg = ModelConfig(num_layers=3, hidden_size=96, num_heads=6, num_kv_heads=2, head_dim=16,
                      intermediate_size=192, seed=4)
    plain, compiled = DecoderModel(cfg), DecoderModel(cfg)
    plain.use_decode_kernel(False)
    assert compiled.use_decode_kernel(True) and compiled.kernels.small_ops is ops
    tokens = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    want, want_kv = forward_one(plain, tokens)
    got, got_kv = forward_one(compiled, tokens)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_kv, want_kv, atol=1e-5, rtol=0)


def test_paged_attention_reads_q_k_v_columns_in_place():
    """The kernel takes q, k and v as the columns of the fused qkv output (each token's
    heads contiguous, rows strided): the same output and pool as contiguous copies."""
    kernel = require_compiled(kernels.paged_attention(), "decode_attention")
    heads, kv_heads, d, rows = 6, 2, 16, 3
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g)
    q = qkv[:, :heads * d].view(rows, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(rows, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(rows, kv_heads, d)
    assert not q.is_contiguous() and not v.is_contiguous()
    base = torch.randn(4, 2, 2, 8, kv_heads, d, generator=g)   # 4 blocks of 8 slots, 2 layers
    # Two sequences: 7 positions then 1 new token, 11 positions then 2 new ones, slots scattered.
    slots = torch.randperm(32, generator=g)[:21]
    args = (1, slots, [0, 8, 21], [7, 11], [1, 2], d ** -0.5)
    outs, pools = [], []
    for qkv_args in ((q, k, v), (q.contiguous(), k.contiguous(), v.contiguous())):
        pool = base.clone()
        outs.append(kernel(*qkv_args, pool, *args))
        pools.append(pool)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(pools[0], pools[1]) and not torch.equal(pools[0], base)
    with pytest.raises(RuntimeError, match="each token's heads contiguous"):
        kernel(q.transpose(1, 2), k, v, base.clone(), *args)
