"""The layer loop in one compiled call (``cluster/engine/layer_loop.py``,
``kernels/layers.cpp``): for the steps it takes (every sequence on the batched attention
kernel, the linears blocked) the same logits and KV as the model's Python loop, bit for bit."""

import dataclasses

import pytest
import torch

from cluster.engine import kernels, linear_layouts
from cluster.engine.model import DecoderModel, ModelConfig
from tests.unit.helpers import require_compiled, tune_blocked
from tests.unit.reference_forward import forward_one

SMALL = ModelConfig(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                    intermediate_size=160, vocab_size=300, max_position=256, seed=4)
# Qwen3's q/k norm and Llama's attention and MLP biases: every optional list of the loop.
WITH_EVERYTHING = dataclasses.replace(SMALL, qk_norm=True, qkv_bias=True, o_bias=True, mlp_bias=True, seed=6)


def blocked_model(config: ModelConfig, monkeypatch, tmp_path) -> DecoderModel:
    model = DecoderModel(config)
    require_compiled(kernels.paged_attention(), "decode_attention")
    require_compiled(kernels.decoder_layers_paged(), "layers")
    model.use_decode_kernel(True)
    if config.qkv_bias or config.o_bias:
        with torch.no_grad():   # lively biases, not the seeded init's small ones
            for layer in model.layers:
                for bias in (layer.qkv_bias, layer.o_bias, layer.gate_up_bias, layer.down_bias):
                    bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(bias.numel())))
    tune_blocked(model, monkeypatch, tmp_path)
    return model


def pool_of(config: ModelConfig, blocks: int = 16, block_tokens: int = 8) -> torch.Tensor:
    c = config
    return torch.zeros(blocks, c.num_layers, 2, block_tokens, c.num_kv_heads, c.head_dim)


def put(pool: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """kv [layers, 2, T, kv_heads, head_dim] at ``slots`` of ``pool``."""
    block_tokens = pool.shape[3]
    pool[slots // block_tokens, :, :, slots % block_tokens] = kv.permute(2, 0, 1, 3, 4)


def step(model: DecoderModel, shared: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One step of three decodes and an extend of 5 tokens after cached prefixes, over a
    pool (with ``shared``, the last three read their common 40-token prefix from the first's
    slots; otherwise each holds its own copy). Returns the logits and the pool after."""
    c = model.config
    g = torch.Generator().manual_seed(11)
    common = torch.randint(0, c.vocab_size, (40,), generator=g)
    seqs = [torch.cat([common, torch.randint(0, c.vocab_size, (n,), generator=g)]) for n in (9, 3, 14, 20)]
    counts = (1, 1, 1, 5)
    pool = pool_of(c, blocks=48)
    free = torch.randperm(pool.shape[0] * pool.shape[3], generator=g).tolist()   # scattered slots

    def take(n: int) -> torch.Tensor:
        return torch.tensor([free.pop() for _ in range(n)])

    first_prefix, items = take(common.numel()), []
    for i, (seq, n) in enumerate(zip(seqs, counts)):
        start = len(seq) - n
        _, past = forward_one(model, seq[:common.numel()], 0, None)   # the same bytes for every sequence
        _, rest = forward_one(model, seq[common.numel():start], common.numel(), past)
        prefix = first_prefix if shared or i == 0 else take(common.numel())
        slots = torch.cat([prefix, take(len(seq) - common.numel())])
        put(pool, slots[:start], torch.cat([past, rest], dim=2))
        items.append((seq[start:], start, slots))
    logits = model.forward_paged(items, pool)
    return logits, pool


@pytest.mark.parametrize("config", [SMALL, WITH_EVERYTHING], ids=["plain", "qk-norm-and-biases"])
@pytest.mark.parametrize("shared", [False, True], ids=["own-prefix", "shared-prefix"])
def test_the_compiled_loop_gives_the_python_loops_logits_and_kv_bit_for_bit(config, shared, monkeypatch,
                                                                              tmp_path):
    model = blocked_model(config, monkeypatch, tmp_path)
    assert model.kernels.layer_loop is not None
    calls = []
    compiled = model.kernels.layer_loop
    model.kernels.layer_loop = lambda *args: calls.append(1) or compiled(*args)
    got_logits, got_pool = step(model, shared)
    assert calls == [1]   # the step took the compiled loop
    model.kernels.layer_loop = None   # the Python loop
    want_logits, want_pool = step(model, shared)
    for got, want in zip(got_logits, want_logits):
        assert torch.equal(got, want)
    assert torch.equal(got_pool, want_pool)   # the new K/V at their slots, the same bits


def test_steps_the_loop_does_not_cover_take_the_python_loop(monkeypatch, tmp_path):
    """A first chunk (no prefix: not on the attention kernel) and a model whose linears are
    not blocked at the step's rows run the Python loop."""
    model = blocked_model(SMALL, monkeypatch, tmp_path)
    calls = []
    compiled = model.kernels.layer_loop
    model.kernels.layer_loop = lambda *args: calls.append(1) or compiled(*args)
    pool, slots = pool_of(SMALL), torch.arange(37, 53)   # across two blocks
    model.forward_paged([(torch.arange(1, 9), 0, slots[:8])], pool)
    assert calls == []
    model.kernels.layer_layouts = (linear_layouts.PLAIN,) * len(model.kernels.layer_layouts)
    model.forward_paged([(torch.tensor([3]), 8, slots[:9])], pool)
    assert calls == []
    model.kernels.layer_layouts = (linear_layouts.BLOCKED,) * len(model.kernels.layer_layouts)
    model.forward_paged([(torch.tensor([4]), 9, slots[:10])], pool)
    assert calls == [1]
    # Without the batched kernel there is no compiled loop at all.
    model.use_decode_kernel(False)
    assert model.kernels.layer_loop is None


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
