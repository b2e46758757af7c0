"""The layer loop in one compiled call (``cluster/engine/layer_loop.py``,
``kernels/layers.cpp``): for the steps it takes (every sequence on the batched attention
kernel, the linears blocked) the same logits and KV as the model's Python loop, bit for bit."""

import dataclasses

import pytest
import torch

from cluster.engine import kernels, linear_layouts
from cluster.engine.model import DecoderModel, ModelConfig
from tests.unit.helpers import require_compiled, tune_blocked

SMALL = ModelConfig(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                    intermediate_size=160, vocab_size=300, max_position=256, seed=4)
# Qwen3's q/k norm and Llama's attention and MLP biases: every optional list of the loop.
WITH_EVERYTHING = dataclasses.replace(SMALL, qk_norm=True, qkv_bias=True, o_bias=True, mlp_bias=True, seed=6)


def blocked_model(config: ModelConfig, monkeypatch, tmp_path) -> DecoderModel:
    model = DecoderModel(config)
    require_compiled(kernels.extend_attention(), "decode_attention")
    require_compiled(kernels.decoder_layers(), "layers")
    model.use_decode_kernel(True)
    if config.qkv_bias or config.o_bias:
        with torch.no_grad():   # lively biases, not the seeded init's small ones
            for layer in model.layers:
                for bias in (layer.qkv_bias, layer.o_bias, layer.gate_up_bias, layer.down_bias):
                    bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(bias.numel())))
    tune_blocked(model, monkeypatch, tmp_path)
    return model


def step(model: DecoderModel, shared: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One step of three decodes and an extend of 5 tokens after cached prefixes (with
    ``shared``, the last three read their common 40-token prefix from the first's buffer)."""
    c = model.config
    g = torch.Generator().manual_seed(11)
    common = torch.randint(0, c.vocab_size, (40,), generator=g)
    seqs = [torch.cat([common, torch.randint(0, c.vocab_size, (n,), generator=g)]) for n in (9, 3, 14, 20)]
    counts = (1, 1, 1, 5)
    buffers, items = [], []
    for seq, n in zip(seqs, counts):
        start = len(seq) - n
        _, past = model.forward_one(seq[:common.numel()], 0, None)   # the same bytes for every sequence
        _, rest = model.forward_one(seq[common.numel():start], common.numel(), past)
        buf = torch.zeros(c.num_layers, 2, c.num_kv_heads, len(seq) + 3, c.head_dim)
        buf[:, :, :, :start] = torch.cat([past, rest], dim=2).transpose(2, 3)
        buffers.append(buf)
        items.append((seq[start:], start, buf))
    reads = [None, (0, 40), (0, 40), (0, 40)] if shared else None
    logits = model.forward_into(items, shared=reads)
    return logits, buffers


@pytest.mark.parametrize("config", [SMALL, WITH_EVERYTHING], ids=["plain", "qk-norm-and-biases"])
@pytest.mark.parametrize("shared", [False, True], ids=["own-prefix", "shared-prefix"])
def test_the_compiled_loop_gives_the_python_loops_logits_and_kv_bit_for_bit(config, shared, monkeypatch,
                                                                              tmp_path):
    model = blocked_model(config, monkeypatch, tmp_path)
    assert model._compiled_layers is not None
    calls = []
    compiled = model._compiled_layers
    model._compiled_layers = lambda *args: calls.append(1) or compiled(*args)
    got_logits, got_kv = step(model, shared)
    assert calls == [1]   # the step took the compiled loop
    model._compiled_layers = None   # the Python loop
    want_logits, want_kv = step(model, shared)
    for got, want in zip(got_logits, want_logits):
        assert torch.equal(got, want)
    for got, want in zip(got_kv, want_kv):
        assert torch.equal(got, want)


def test_steps_the_loop_does_not_cover_take_the_python_loop(monkeypatch, tmp_path):
    """A first chunk (no prefix: not on the attention kernel) and a model whose linears are
    not blocked at the step's rows run the Python loop."""
    model = blocked_model(SMALL, monkeypatch, tmp_path)
    calls = []
    compiled = model._compiled_layers
    model._compiled_layers = lambda *args: calls.append(1) or compiled(*args)
    buf = torch.zeros(SMALL.num_layers, 2, SMALL.num_kv_heads, 16, SMALL.head_dim)
    model.forward_into([(torch.arange(1, 9), 0, buf)])
    assert calls == []
    model._layer_layouts = (linear_layouts.PLAIN,) * len(model._layer_layouts)
    model.forward_into([(torch.tensor([3]), 8, buf)])
    assert calls == []
    model._layer_layouts = (linear_layouts.BLOCKED,) * len(model._layer_layouts)
    model.forward_into([(torch.tensor([4]), 9, buf)])
    assert calls == [1]
    # Without the batched kernel there is no compiled loop at all.
    model.use_decode_kernel(False)
    assert model._compiled_layers is None


def test_the_layer_loop_module_is_rebuilt_when_a_kernel_it_includes_changes(monkeypatch, tmp_path):
    """The extension loader decides whether a built module is current from the listed source
    and the flags; ``layers.cpp`` includes the two kernels, so their contents go into its flags."""
    import hashlib
    from pathlib import Path

    import torch.utils.cpp_extension

    seen = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: seen.append(kwargs) or object())
    monkeypatch.setitem(kernels._state, "layers", {"module": None, "tried": False, "error": None})
    kernels._module("layers")
    here = Path(kernels.__file__).parent
    want = hashlib.sha256((here / "blocked_linear.cpp").read_bytes() +
                          (here / "decode_attention.cpp").read_bytes()).hexdigest()[:16]
    assert seen and f"-DPREFIX_CACHE_INCLUDES={want}" in seen[0]["extra_cflags"]
    assert seen[0]["sources"] == [str(here / "layers.cpp")]
