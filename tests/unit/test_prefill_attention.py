"""``prefill_attention`` (``cluster/engine/kernels/prefill_attention.cpp``): a prompt chunk's
causal attention over its sequence's K/V in one flash pass. Its output equals a float64
masked softmax to float32 rounding for any chunk length, cached prefix and head grouping,
and ``forward_paged`` uses it for prompt chunks (not for decodes) with the reference
forward's logits."""

from types import SimpleNamespace

import pytest
import torch

from cluster.engine import kernels
from cluster.engine.attention import attend_torch
from cluster.engine.model import DecoderModel, ModelConfig
from cluster.engine.paged import prefill_fits
from tests.unit.helpers import require_compiled
from tests.unit.reference_forward import forward_one


def the_kernel():
    fn = kernels.prefill_attention()
    if fn is None and kernels.status("prefill_attention") == "compiled":
        pytest.skip("this CPU has no AVX-512: prompt chunks stay on SDPA")
    return require_compiled(fn, "prefill_attention")


def masked_softmax(q, keys, values, start):
    """float64 reference: query i (at start + i) sees keys 0..start + i."""
    heads, kv_heads = q.shape[1], keys.shape[0]
    k = keys.double().repeat_interleave(heads // kv_heads, 0)
    v = values.double().repeat_interleave(heads // kv_heads, 0)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * q.shape[2] ** -0.5
    n = q.shape[0]
    visible = torch.arange(start + n)[None, :] <= (start + torch.arange(n))[:, None]
    return (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v).transpose(0, 1)


# (start, new tokens, query heads, KV heads): tile and block edges (16 tokens, 64 keys),
# no prefix, long prefixes, one KV head per query head and up to 8 per KV head.
CASES = [(0, 1, 9, 3), (0, 2, 9, 3), (0, 16, 9, 3), (0, 17, 9, 3), (0, 64, 3, 3), (0, 65, 4, 1),
         (0, 512, 9, 3), (512, 512, 9, 3), (1024, 276, 9, 3), (5, 33, 8, 1), (63, 1, 6, 2),
         (64, 40, 2, 2), (1000, 7, 16, 2)]


@pytest.mark.parametrize("start,new,heads,kv_heads", CASES)
def test_prefill_attention_equals_a_float64_masked_softmax(start, new, heads, kv_heads):
    fn = the_kernel()
    g = torch.Generator().manual_seed(start * 7 + new)
    q = torch.randn(new, heads, 64, generator=g) * 2
    keys = torch.randn(kv_heads, start + new, 64, generator=g) * 2
    values = torch.randn(kv_heads, start + new, 64, generator=g)
    got = fn(q, keys, values, start, 64 ** -0.5)
    assert got.shape == (new, heads, 64) and got.dtype == torch.float32
    want = masked_softmax(q, keys, values, start)
    # As close to it as SDPA's flash kernel (the torch path) gets, within float32 rounding.
    sdpa = attend_torch(SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=64), q, keys, values, start)
    assert (got.double() - want).abs().max() <= 2 * (sdpa.double() - want).abs().max() + 1e-6
    # The same numbers however many threads run the tiles.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(fn(q, keys, values, start, 64 ** -0.5), got)
    finally:
        torch.set_num_threads(threads)


def test_prefill_attention_rejects_what_it_does_not_serve():
    fn = the_kernel()
    q, kv = torch.zeros(4, 9, 64), torch.zeros(3, 4, 64)
    with pytest.raises(RuntimeError, match="head_dim 64"):
        fn(torch.zeros(4, 9, 32), torch.zeros(3, 4, 32), torch.zeros(3, 4, 32), 0, 1.0)
    with pytest.raises(RuntimeError, match="start \\+ T"):
        fn(q, kv, kv, 1, 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        fn(q.double(), kv.double(), kv.double(), 0, 1.0)
    with pytest.raises(RuntimeError, match="at most 8"):
        fn(torch.zeros(4, 9, 64), torch.zeros(1, 4, 64), torch.zeros(1, 4, 64), 0, 1.0)


GQA = ModelConfig(hidden_size=192, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=64,
                  intermediate_size=256, vocab_size=300, max_position=1024, seed=11)


def test_forward_paged_attends_prompt_chunks_with_it():
    """A prompt in chunks (the second after a cached prefix) and a decode: the chunks go
    through the kernel once a layer each, the decode does not; logits equal the reference
    forward's over the whole sequence."""
    the_kernel()
    model = DecoderModel(GQA)
    model.use_decode_kernel(True)
    assert prefill_fits(GQA) and model.kernels.prefill is not None
    calls = []
    inner = model.kernels.prefill
    model.kernels.prefill = lambda q, k, v, start, scale: calls.append((q.shape[0], start)) or inner(q, k, v, start,
                                                                                                      scale)
    tokens = torch.randint(0, GQA.vocab_size, (300,), generator=torch.Generator().manual_seed(2))
    want, _ = forward_one(model, tokens, 0, None)
    c = GQA
    pool = torch.zeros(32, c.num_layers, 2, 16, c.num_kv_heads, c.head_dim)
    slots = torch.randperm(32 * 16, generator=torch.Generator().manual_seed(3))[:300]
    got = [model.forward_paged([(tokens[a:b], a, slots[:b])], pool)[0] for a, b in ((0, 200), (200, 299), (299, 300))]
    assert calls == [(200, 0)] * c.num_layers + [(99, 200)] * c.num_layers
    torch.testing.assert_close(torch.cat(got), want, rtol=0, atol=1e-5)


def test_models_it_does_not_fit_keep_sdpa():
    assert not prefill_fits(ModelConfig(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                                        intermediate_size=64, vocab_size=50, max_position=64))
    model = DecoderModel(ModelConfig(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                                     intermediate_size=64, vocab_size=50, max_position=64))
    model.use_decode_kernel(True)
    assert model.kernels.prefill is None
