"""The blocked linear (cluster/engine/kernels/blocked_linear.cpp, layout ``blocked`` of
cluster/engine/linear_layouts.py): the order it sums in, and MKL's large-batch numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cluster.engine import kernels, linear_layouts
from cluster.engine.model import DecoderModel, ModelConfig
from tests.unit.helpers import require_compiled, tune_blocked
from tests.unit.reference_forward import forward_batch

SMALL = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    intermediate_size=160, vocab_size=300, max_position=256)


@pytest.fixture(scope="module")
def module():
    return require_compiled(kernels.blocked_linear(), "blocked_linear")


def _balanced(n: int, size: int) -> list[int]:
    pieces = -(-n // size)
    return [n // pieces + (1 if i < n % pieces else 0) for i in range(pieces)]


def reference(x: np.ndarray, w: np.ndarray, parts: int, kc: int) -> np.ndarray:
    """The documented order, one output at a time: K in ``parts`` balanced parts, each in
    balanced blocks of at most ``kc``; a block one fused multiply-add after the other from
    zero (a product of two float32 is exact in float64: the sum in float64 rounded to
    float32 is the FMA but where the float64 sum lands on a float32 tie, which these
    fixed inputs do not); the blocks of a part added left to right, then the parts."""
    m_rows, k_total = x.shape
    out = np.zeros((m_rows, w.shape[0]), dtype=np.float32)
    for m in range(m_rows):
        for n in range(w.shape[0]):
            total, k = None, 0
            for part_size in _balanced(k_total, -(-k_total // parts)):
                part = None
                for size in _balanced(part_size, kc):
                    acc = np.float32(0)
                    for j in range(k, k + size):
                        acc = np.float32(np.float64(x[m, j]) * np.float64(w[n, j]) + np.float64(acc))
                    k += size
                    part = acc if part is None else np.float32(part + acc)
                total = part if total is None else np.float32(total + part)
            out[m, n] = total
    return out


@pytest.mark.parametrize("rows,n,k,parts,kc", [(1, 64, 40, 1, 40), (3, 70, 40, 2, 16), (6, 130, 37, 2, 7),
                                               (5, 17, 50, 3, 12)])
def test_the_kernel_sums_in_the_order_it_is_told(module, rows, n, k, parts, kc) -> None:
    """Every output, to the bit, for panels cut at 64 columns with a ragged last one, rows
    in tiles of four with a remainder, parts and blocks of unequal sizes."""
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = (torch.randint(-8, 8, (rows, k), generator=gen).float() / 8)
    w = (torch.randint(-8, 8, (n, k), generator=gen).float() / 16) + torch.randn(n, k, generator=gen) * 1e-3
    got = module.blocked_linear(x, module.pack_panels(w), n, parts, kc)
    assert got.shape == (rows, n)
    assert np.array_equal(got.numpy(), reference(x.numpy(), w.numpy(), parts, kc))


@pytest.mark.parametrize("rows", [1, 8, 37])
def test_a_residual_is_added_inside_the_call_with_the_bits_of_a_separate_add(module, rows) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=gen), torch.randn(130, 96, generator=gen)
    residual = torch.randn(rows, 130, generator=gen) * 100
    panels = module.pack_panels(w)
    plain = module.blocked_linear(x, panels, 130, 2, 32)
    assert torch.equal(module.blocked_linear(x, panels, 130, 2, 32, residual), residual + plain)
    assert torch.equal(linear_layouts.linear(x, w, None, linear_layouts.PLAIN, None, residual),
                       residual + torch.nn.functional.linear(x, w))
    with pytest.raises(RuntimeError, match="residual float32 \\[M, n\\]"):
        module.blocked_linear(x, panels, 130, 2, 32, residual[:, :64])


def test_a_found_order_gives_mkl_large_batch_numbers_at_every_row_count(module) -> None:
    """Where ``blocked_order`` finds an order on this machine (the linears of SmolLM2-135M:
    its shapes, random weights), the kernel gives at each row count exactly the rows
    ``F.linear`` gives for a prompt of 1024 tokens: the numbers no longer depend on how
    many rows a step has (MKL's own change below 16 rows, and between 64 and 160 for some)."""
    gen = torch.Generator().manual_seed(7)
    pairs = [(torch.randn(n, k, generator=gen) * 0.05, None) for n, k in ((1728, 576), (576, 576), (3072, 576),
                                                                          (576, 1536))]
    order = linear_layouts.blocked_order(pairs)
    if order is None:
        pytest.skip("no summation order of MKL's found on this machine: the layout is not used here")
    for weight, _ in pairs:
        x = torch.randn(1024, weight.shape[1], generator=gen)
        big = torch.nn.functional.linear(x, weight)
        p = linear_layouts.panels(weight, order)
        for rows in (*range(1, 20), 31, 32, 33, 64, 100, 128, 200):
            assert torch.equal(linear_layouts.linear(x[:rows], weight, None, linear_layouts.BLOCKED, p), big[:rows])


def test_a_wrong_order_or_a_bias_added_differently_is_not_used(module, monkeypatch) -> None:
    """With no block size that matches MKL's, ``blocked_order`` says None and ``tuned``
    leaves the layout out, however fast it would be."""
    monkeypatch.setattr(linear_layouts, "BLOCK_SIZES", (5,))
    monkeypatch.setattr(linear_layouts, "_orders", {})
    monkeypatch.setattr(linear_layouts, "_known", {})
    weight = torch.randn(96, 576)
    assert linear_layouts.blocked_order([(weight, None)]) is None
    monkeypatch.setattr(linear_layouts, "_time", lambda weights, rows, layout, packs, **_:
                        -1.0 if layout == linear_layouts.BLOCKED else float(layout))
    assert linear_layouts.BLOCKED not in linear_layouts.tuned([weight], "float32")


def test_a_model_running_blocked_gives_one_prompt_the_logits_of_a_large_batch(module, monkeypatch,
                                                                                 tmp_path) -> None:
    """A prompt forwarded alone (its few rows on the kernel) gets bit for bit the logits and
    KV it gets inside a 64-row batch on MKL; and tuning builds the panels of a group only
    when some row count of it runs blocked."""
    model = DecoderModel(SMALL)
    tuned = tune_blocked(model, monkeypatch, tmp_path)
    assert set(tuned["layers"].values()) == {"blocked"}
    assert all((linear_layouts.BLOCKED, id(w)) in model.kernels.packed for w in (model.layers[0].qkv_proj,
                                                                           model.layers[1].down_proj))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, SMALL.vocab_size, (n,), generator=gen) for n in (3, 5, 8, 16, 32)]
    assert linear_layouts.layout_for(model.kernels.layer_layouts, 64) == linear_layouts.BLOCKED
    model.kernels.layer_layouts = (linear_layouts.PLAIN,) * len(model.kernels.layer_layouts)   # the batch on MKL
    batch = forward_batch(model, [(p, 0, None) for p in prompts])
    model.tune_linears()   # blocked again (remembered)
    for prompt, (logits, kv) in zip(prompts, batch):
        alone_logits, alone_kv = forward_batch(model, [(prompt, 0, None)])[0]
        assert torch.equal(alone_kv, kv)
        if linear_layouts.BLOCKED in model.kernels.head_layouts:
            assert torch.equal(alone_logits, logits)


def test_a_long_prompt_on_the_kernel_gets_mkls_numbers_bit_for_bit(module, monkeypatch, tmp_path) -> None:
    """Prefill chunks run blocked too (``TUNED_ROWS`` reach the step budget): a prompt of 250
    rows, which the kernel cuts into tasks of a panel for 64 of its rows (the last one short),
    gets the logits and KV MKL's ``x @ W^T`` gives it, bit for bit."""
    model = DecoderModel(SMALL)
    tune_blocked(model, monkeypatch, tmp_path)
    assert linear_layouts.layout_for(model.kernels.layer_layouts, 250) == linear_layouts.BLOCKED
    prompt = torch.randint(0, SMALL.vocab_size, (250,), generator=torch.Generator().manual_seed(5))
    blocked_logits, blocked_kv = forward_batch(model, [(prompt, 0, None)])[0]
    model.kernels.layer_layouts = (linear_layouts.PLAIN,) * len(model.kernels.layer_layouts)
    model.kernels.head_layouts = (linear_layouts.PLAIN,) * len(model.kernels.head_layouts)
    logits, kv = forward_batch(model, [(prompt, 0, None)])[0]
    assert torch.equal(blocked_kv, kv)
    assert torch.equal(blocked_logits, logits)


def test_the_tuning_takes_each_layouts_fastest_round_and_keeps_blocked_unless_clearly_beaten(monkeypatch) -> None:
    """``_fastest``: the candidates are timed in interleaved rounds and each keeps its fastest
    round, so one slow round (a moment of load) does not pick a slower layout for good (as one
    timed pass did: x @ W^T for 32-63 rows at three times blocked's time); another layout
    replaces blocked only where it is more than ``BLOCKED_MARGIN`` faster."""
    plain, blocked = linear_layouts.PLAIN, linear_layouts.BLOCKED
    rounds = {plain: iter([0.067, 0.067, 0.067]), blocked: iter([0.300, 0.023, 0.023])}   # blocked's 1st round hit
    calls = []

    def timed(weights, rows, layout, packs, warm=True):
        calls.append((layout, warm))
        return next(rounds[layout])

    monkeypatch.setattr(linear_layouts, "_time", timed)
    assert linear_layouts._fastest([], 32, [plain, blocked], {}) == blocked
    assert calls == [(plain, True), (blocked, True), (plain, False), (blocked, False), (plain, False),
                     (blocked, False)]   # in turn, warmed up in the first round only
    for plain_s, want in ((0.095, blocked), (0.080, plain)):   # 5% faster: blocked stays; 20%: plain
        monkeypatch.setattr(linear_layouts, "_time", lambda w, r, layout, p, warm=True, s=plain_s:
                            s if layout == plain else 0.100)
        assert linear_layouts._fastest([], 32, [plain, blocked], {}) == want
    monkeypatch.setattr(linear_layouts, "_time", lambda w, r, layout, p, warm=True: 0.08 if layout == plain else 0.1)
    assert linear_layouts._fastest([], 32, [plain, linear_layouts.TRANSPOSED], {}) == plain   # no blocked: fastest
