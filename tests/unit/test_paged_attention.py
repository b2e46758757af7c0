"""``DecoderModel.forward_paged``: attention reads K/V in place from a slotted KV pool
through per-sequence slot tables (``cluster/engine/paged.py``, ``paged_attention`` in
``kernels/decode_attention.cpp``). The logits are the reference forward's (``forward_one``),
and the same bits wherever in the pool the slots lie (scattered over random blocks and
offsets, or in order as in one buffer); the new K/V land at exactly their slots and nothing
else in the pool changes."""

import dataclasses

import pytest
import torch

from cluster.engine import kernels
from cluster.engine.attention import EXTEND_MAX
from cluster.engine.model import DecoderModel, ModelConfig
from tests.unit.helpers import require_compiled
from tests.unit.reference_forward import forward_one

SMALL = ModelConfig(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                    intermediate_size=160, vocab_size=300, max_position=512, seed=4)
# head_dim 64: the kernel's AVX2 path.
WIDE = dataclasses.replace(SMALL, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64, seed=5)
BLOCK_TOKENS, NUM_BLOCKS = 16, 96


class Pool:
    """A pool tensor in KVPool's layout and a scattered allocator of slots: extents of
    random lengths at random offsets in random blocks."""

    def __init__(self, config: ModelConfig, seed: int):
        c = config
        self.tensor = torch.randn(NUM_BLOCKS, c.num_layers, 2, BLOCK_TOKENS, c.num_kv_heads, c.head_dim,
                                  generator=torch.Generator().manual_seed(seed))   # junk where nothing was written
        self.free = torch.ones(NUM_BLOCKS * BLOCK_TOKENS, dtype=torch.bool)
        self.g = torch.Generator().manual_seed(seed + 1)

    def take(self, n: int) -> torch.Tensor:
        slots = []
        while len(slots) < n:
            free = self.free.nonzero().flatten()
            start = int(free[torch.randint(0, free.numel(), (1,), generator=self.g)])
            run = int(torch.randint(1, 9, (1,), generator=self.g))
            slot = start
            while len(slots) < n and run and self.free[slot] and (slot == start or slot % BLOCK_TOKENS):
                self.free[slot] = False
                slots.append(slot)
                slot, run = slot + 1, run - 1
                if slot == self.free.numel():
                    break
        return torch.tensor(slots, dtype=torch.long)

    def take_in_order(self, n: int) -> torch.Tensor:
        """The first ``n`` free slots, in order (a sequence laid out as one buffer)."""
        slots = self.free.nonzero().flatten()[:n]
        self.free[slots] = False
        return slots

    def put(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """kv [layers, 2, T, kv_heads, head_dim] at ``slots``."""
        self.tensor[slots // BLOCK_TOKENS, :, :, slots % BLOCK_TOKENS] = kv.permute(2, 0, 1, 3, 4)

    def get(self, slots: torch.Tensor) -> torch.Tensor:
        return self.tensor[slots // BLOCK_TOKENS, :, :, slots % BLOCK_TOKENS].permute(1, 2, 0, 3, 4)


def model_of(config: ModelConfig, kernel: bool) -> DecoderModel:
    model = DecoderModel(config)
    if kernel:
        require_compiled(kernels.paged_attention(), "decode_attention")
    model.use_decode_kernel(kernel)
    return model


def sequences(config: ModelConfig, plan, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, config.vocab_size, (p + n,), generator=g) for p, n in plan]


# (start_pos, new tokens): decodes, short extends (<= EXTEND_MAX), long chunks after a
# prefix, and prefills from position 0.
MIXED = [(37, 1), (90, 1), (20, 5), (61, EXTEND_MAX), (33, EXTEND_MAX + 8), (0, 30), (15, 1), (0, 1)]


def run_paged(model: DecoderModel, plan, seed: int = 3, scattered: bool = True):
    """forward_paged over the items of ``plan``, their slots scattered (or in order); the
    reference logits and KV from forward_one over each whole sequence."""
    c = model.config
    pool = Pool(c, seed)
    seqs = sequences(c, plan, seed)
    refs = [forward_one(model, seq, 0, None) for seq in seqs]
    tables, items = [], []
    for seq, (p, n), (_, kv) in zip(seqs, plan, refs):
        slots = pool.take(p + n) if scattered else pool.take_in_order(p + n)
        pool.put(slots[:p], kv[:, :, :p])
        tables.append(slots)
        items.append((seq[p:], p, slots))
    before = pool.tensor.clone()
    return pool, before, tables, refs, model.forward_paged(items, pool.tensor)


@pytest.mark.parametrize("config", [SMALL, WIDE], ids=["head-dim-16", "head-dim-64"])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_paged_logits_equal_the_reference_wherever_the_slots_lie(config, kernel):
    model = model_of(config, kernel)
    calls = []
    if kernel:
        inner = model.kernels.attention
        model.kernels.attention = lambda *args: calls.append(args[4]) or inner(*args)
    pool, before, tables, refs, paged = run_paged(model, MIXED)
    assert calls == (list(range(config.num_layers)) if kernel else [])   # one kernel call a layer
    in_order, _, order_tables, _, want = run_paged(model, MIXED, scattered=False)
    written = torch.zeros(NUM_BLOCKS * BLOCK_TOKENS, dtype=torch.bool)
    for (p, n), slots, (logits_ref, kv_ref), got, same, ordered in zip(MIXED, tables, refs, paged, want,
                                                                      order_tables):
        assert got.shape == (n, config.vocab_size)
        torch.testing.assert_close(got, logits_ref[p:], rtol=0, atol=1e-5)
        new_kv = pool.get(slots[p:])
        torch.testing.assert_close(new_kv, kv_ref[:, :, p:], rtol=0, atol=1e-5)
        # The same arithmetic in the same order over scattered slots as over slots in order.
        assert torch.equal(got, same)
        assert torch.equal(new_kv, in_order.get(ordered[p:]))
        written[slots[p:]] = True
    assert not torch.equal(torch.cat(tables), torch.cat(order_tables))   # the two layouts differ
    # Nothing but the new tokens' slots changed.
    untouched = (~written).nonzero().flatten()
    pool_before = Pool(config, 0)
    pool_before.tensor = before
    assert torch.equal(pool.get(untouched), pool_before.get(untouched))


def test_items_sharing_a_prefix_read_the_same_slots():
    """Two requests on one cached prefix: their tables share the prefix's slots (reads only);
    each gets its own sequence's logits."""
    model = model_of(WIDE, True)
    c = model.config
    pool = Pool(c, 8)
    g = torch.Generator().manual_seed(9)
    prefix = torch.randint(0, c.vocab_size, (45,), generator=g)
    tails = [torch.randint(0, c.vocab_size, (n,), generator=g) for n in (1, 4, 40)]
    _, prefix_kv = forward_one(model, prefix, 0, None)
    shared = pool.take(45)
    pool.put(shared, prefix_kv)
    items, refs = [], []
    for tail in tails:
        slots = torch.cat([shared, pool.take(tail.numel())])
        items.append((tail, 45, slots))
        refs.append(forward_one(model, torch.cat([prefix, tail]), 0, None))
    before = pool.get(shared).clone()
    got = model.forward_paged(items, pool.tensor)
    for logits, (ref, kv), (tail, _, slots) in zip(got, refs, items):
        torch.testing.assert_close(logits, ref[45:], rtol=0, atol=1e-5)
        torch.testing.assert_close(pool.get(slots[45:]), kv[:, :, 45:], rtol=0, atol=1e-5)
    assert torch.equal(pool.get(shared), before)


def test_a_kernel_item_reads_what_a_prefill_of_the_same_step_writes():
    """A prompt filled from position 0 (the torch path) and a request behind it on its first
    20 tokens (the kernel): the prefill's K/V of each layer are written before the kernel
    reads them."""
    model = model_of(SMALL, True)
    c = model.config
    pool = Pool(c, 12)
    g = torch.Generator().manual_seed(13)
    prompt = torch.randint(0, c.vocab_size, (40,), generator=g)
    tail = torch.randint(0, c.vocab_size, (3,), generator=g)
    prompt_slots = pool.take(40)
    behind = torch.cat([prompt_slots[:20], pool.take(3)])
    got = model.forward_paged([(prompt, 0, prompt_slots), (tail, 20, behind)], pool.tensor)
    torch.testing.assert_close(got[0], forward_one(model, prompt, 0, None)[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1], forward_one(model, torch.cat([prompt[:20], tail]), 0, None)[0][20:],
                               rtol=0, atol=1e-5)


def test_the_compiled_layer_loop_takes_paged_steps_bit_for_bit(monkeypatch, tmp_path):
    """Every item on the kernel and the linears blocked: the whole loop in one compiled call
    over the slot tables, the same logits and KV as the Python loop, wherever the slots lie."""
    from tests.unit.test_layer_loop import blocked_model

    model = blocked_model(SMALL, monkeypatch, tmp_path)
    plan = [(40, 1), (52, 1), (43, 1), (60, 5)]
    calls = []
    compiled = model.kernels.layer_loop
    model.kernels.layer_loop = lambda *args: calls.append(1) or compiled(*args)
    pool, _, tables, refs, got = run_paged(model, plan)
    in_order, _, order_tables, _, ordered = run_paged(model, plan, scattered=False)
    assert calls == [1, 1]   # each forward in the compiled loop
    new_kv = [pool.get(slots[p:]) for (p, _), slots in zip(plan, tables)]
    model.kernels.layer_loop = None   # the Python loop
    pool2, _, tables2, _, want = run_paged(model, plan)
    for a, b, c_, (p, _), (ref, _) in zip(got, want, ordered, plan, refs):
        assert torch.equal(a, b) and torch.equal(a, c_)
        torch.testing.assert_close(a, ref[p:], rtol=0, atol=1e-5)
    for kv, (p, _), slots, ordered_slots in zip(new_kv, plan, tables2, order_tables):
        assert torch.equal(kv, pool2.get(slots[p:]))
        assert torch.equal(kv, in_order.get(ordered_slots[p:]))


def test_bad_slot_tables_raise_clear_value_errors():
    model = model_of(SMALL, True)
    c = model.config
    pool = Pool(c, 20)
    tokens = torch.tensor([1, 2])
    slots = pool.take(7)
    with pytest.raises(ValueError, match="slots has 6 entries; the sequence has start_pos \\+ len\\(tokens\\) = 5 "
                                         "\\+ 2 = 7 positions"):
        model.forward_paged([(tokens, 5, slots[:6])], pool.tensor)
    capacity = NUM_BLOCKS * BLOCK_TOKENS
    for bad in (capacity, -1):
        wrong = slots.clone()
        wrong[3] = bad
        with pytest.raises(ValueError, match=f"slot {bad} is out of range: the pool has slots \\[0, {capacity}\\)"):
            model.forward_paged([(tokens, 5, wrong)], pool.tensor)
    with pytest.raises(ValueError, match="slots must be a 1-D integer tensor"):
        model.forward_paged([(tokens, 5, slots.float())], pool.tensor)
    other = pool.take(7)
    twice = torch.cat([other[:6], slots[6:]])
    with pytest.raises(ValueError, match=f"slot {int(slots[6])} is written by more than one new token"):
        model.forward_paged([(tokens[:1], 6, slots), (tokens[:1], 6, twice)], pool.tensor)
    # A kernel item writes what another reads in its prefix: read while it is written.
    reader = torch.cat([slots[:5], slots[5:6], pool.take(1)])
    with pytest.raises(ValueError, match="items\\[1\\] reads slot .* which items\\[0\\] writes"):
        model.forward_paged([(tokens, 5, slots), (tokens[:1], 6, reader)], pool.tensor)
    with pytest.raises(ValueError, match="does not hold this model's KV"):
        model.forward_paged([(tokens, 5, slots)], pool.tensor[:, :2])
    with pytest.raises(ValueError, match="pool is torch.float64"):
        model.forward_paged([(tokens, 5, slots)], pool.tensor.double())


CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("graphs", [pytest.param(False, marks=CUDA), pytest.param(True, marks=CUDA)])
def test_on_cuda_the_triton_kernel_and_its_graphs_attend_over_the_slots(graphs):
    """The Triton twin of the paged kernel (``triton_attention.paged_attention``) in an eager
    mixed step, and a step of decodes alone replayed from a CUDA graph (``DecodeGraphs.run``): the
    reference logits, the new K/V at their slots."""
    from tests.requirements import TRITON, require

    model = DecoderModel(SMALL).cuda()
    require(TRITON, model.use_decode_kernel(True), "Triton is not importable here")
    if graphs:
        assert model.use_cuda_graphs(True, sizes=(4,))
    plan = [(37, 1), (90, 1), (15, 1)] if graphs else MIXED
    pool = Pool(SMALL, 3)
    pool.tensor = pool.tensor.cuda()
    items, refs = [], []
    for seq, (p, n) in zip(sequences(SMALL, plan, 3), plan):
        logits, kv = forward_one(model, seq, 0, None)
        slots = pool.take(p + n)
        pool.put(slots[:p].cuda(), kv[:, :, :p])
        items.append((seq[p:], p, slots))
        refs.append((logits, kv))
    got = model.forward_paged(items, pool.tensor)
    assert model.graph_stats.get("replays", 0) == (1 if graphs else 0)
    for logits, (ref, kv), (_, p, slots) in zip(got, refs, items):
        torch.testing.assert_close(logits, ref[p:], rtol=0, atol=1e-4)
        torch.testing.assert_close(pool.get(slots[p:].cuda()), kv[:, :, p:], rtol=0, atol=1e-4)


def test_slots_of_extents_lists_each_position_s_slot_in_order():
    from cluster.cache.lease import extent_slots   # what a lease builds its slot table with

    assert extent_slots([(3, 5, 2), (0, 14, 2), (7, 0, 3)], 16) == [53, 54, 14, 15, 112, 113, 114]
    assert extent_slots([], 16) == []
