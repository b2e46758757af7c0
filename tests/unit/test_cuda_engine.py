"""The packed decoder and the engine on CUDA: the Triton attention over a slotted KV pool
(``kernels/triton_attention``) equals the torch path, CUDA-graph decode steps of
``forward_paged`` (``cluster.engine.cuda_graphs``) equal eager ones, and the engine on a
CUDA HOT pool produces what the model's own reference forward predicts. Skipped without a CUDA device and Triton (the GPU check script runs them), except
the engine test's CPU twin."""

import pytest
import torch

from cluster.cache.kv_pool import KVLayout
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.engine import attention
from cluster.engine.model import DecoderModel, ModelConfig
from cluster.engine.engine import Engine, EngineRequest, SamplingParams
from tests.requirements import TRITON, require
from tests.unit.reference_forward import forward_one

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CONFIG = dict(num_layers=3, hidden_size=192, num_heads=6, num_kv_heads=2, head_dim=32, intermediate_size=256,
              vocab_size=400, seed=5)
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module")
def kernel():
    from cluster.engine.kernels import cuda_paged_attention

    module = cuda_paged_attention()
    require(TRITON, module is not None, "Triton is not importable here (it ships with torch's CUDA builds)")
    return module


class _Shapes:
    num_heads, num_kv_heads, head_dim = 6, 2, 32


BLOCK_TOKENS = 16


def _at(pool: torch.Tensor, slots: torch.Tensor, layer: int, kv: int) -> torch.Tensor:
    """The K (kv 0) or V (1) rows of ``layer`` at ``slots``: [len(slots), kv_heads, head_dim]."""
    slots = slots.to(pool.device)
    return pool[slots // BLOCK_TOKENS, layer, kv, slots % BLOCK_TOKENS]


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=CUDA), pytest.param(torch.bfloat16, marks=CUDA)])
def test_triton_attention_equals_the_torch_path(kernel, dtype):
    c, layer, blocks = _Shapes, 1, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    items = [(1, 70), (5, 130), (1, 3), (32, 40), (1, 200)]   # (new tokens, cached prefix)
    pool = torch.randn(blocks, 2, 2, BLOCK_TOKENS, c.num_kv_heads, c.head_dim, generator=gen, device="cuda",
                       dtype=dtype)
    order = torch.randperm(blocks * BLOCK_TOKENS, generator=torch.Generator().manual_seed(1))   # scattered slots
    tables, taken = [], 0
    for i, (n, start) in enumerate(items):
        own = start + n - (100 if i == 4 else 0)   # item 4 reads item 1's first 100 slots as its own
        slots = order[taken:taken + own]
        taken += own
        tables.append(torch.cat([tables[1][:100], slots]) if i == 4 else slots)
    rows = sum(n for n, _ in items)
    q = torch.randn(rows, c.num_heads, c.head_dim, generator=gen, device="cuda", dtype=dtype)
    k = torch.randn(rows, c.num_kv_heads, c.head_dim, generator=gen, device="cuda", dtype=dtype)
    v = torch.randn(rows, c.num_kv_heads, c.head_dim, generator=gen, device="cuda", dtype=dtype)
    expected_pool = pool.clone()
    outs, r = [], 0
    for (n, start), slots in zip(items, tables):
        cuda_slots = slots.cuda()
        new = cuda_slots[start:]
        expected_pool[new // BLOCK_TOKENS, layer, 0, new % BLOCK_TOKENS] = k[r:r + n]
        expected_pool[new // BLOCK_TOKENS, layer, 1, new % BLOCK_TOKENS] = v[r:r + n]
        keys, values = _at(expected_pool, slots, layer, 0), _at(expected_pool, slots, layer, 1)
        outs.append(attention.attend_torch(c, q[r:r + n], keys.transpose(0, 1), values.transpose(0, 1), start))
        r += n
    expected = torch.cat(outs).float()
    starts = [0]
    for slots in tables:
        starts.append(starts[-1] + slots.numel())
    batch = kernel.prepare_paged(pool, torch.cat(tables), starts, [s for _, s in items], [n for n, _ in items])
    out = kernel.paged_attention(q, k, v, batch, layer, c.head_dim ** -0.5)
    assert (out.float() - expected).abs().max().item() < TOL[dtype]
    assert torch.equal(pool, expected_pool)   # the new K/V written at their slots, nothing else touched


def _model(dtype: str, device: str) -> DecoderModel:
    return DecoderModel(ModelConfig(**CONFIG, dtype=dtype)).to(device)


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=CUDA), pytest.param("bfloat16", marks=CUDA)])
def test_graph_decode_steps_equal_eager_and_the_cpu_model(kernel, dtype):
    torch_dtype = getattr(torch, dtype)
    gpu = _model(dtype, "cuda")
    assert gpu.use_decode_kernel() and gpu.use_cuda_graphs(sizes=(1, 4, 8))
    eager = _model(dtype, "cuda")
    assert eager.use_decode_kernel() and not eager.use_cuda_graphs(False)
    cpu = _model("float32", "cpu")
    cpu.use_decode_kernel(False)
    c = gpu.config
    prompts = [list(range(3 + i, 40 + 7 * i)) for i in range(3)]
    capacity = 128   # slots per sequence, scattered over the pool's blocks
    order = torch.randperm(len(prompts) * capacity, generator=torch.Generator().manual_seed(3))
    tables = [order[i * capacity:(i + 1) * capacity] for i in range(len(prompts))]

    def pool(device, dt):
        return torch.zeros(len(prompts) * capacity // BLOCK_TOKENS, c.num_layers, 2, BLOCK_TOKENS, c.num_kv_heads,
                           c.head_dim, dtype=dt, device=device)

    pools = {"gpu": pool("cuda", torch_dtype), "eager": pool("cuda", torch_dtype), "cpu": pool("cpu", torch.float32)}
    models = {"gpu": gpu, "eager": eager, "cpu": cpu}
    lengths = [len(p) for p in prompts]
    for name, model in models.items():
        model.forward_paged([(torch.tensor(p), 0, table[:len(p)]) for p, table in zip(prompts, tables)], pools[name],
                            last_logits_only=True)
    next_tokens = [[11, 12, 13], [14, 15, 16], [17, 18, 19], [20, 21, 22]]
    for step, toks in enumerate(next_tokens):
        # Step 2 adds a few tokens to the second sequence (an eager step on the kernel), the rest decode.
        tokens = [torch.tensor([t]) for t in toks]
        if step == 2:
            tokens[1] = torch.tensor([toks[1], 5, 6, 7])
        items = [(t, n, table[:n + t.numel()]) for t, n, table in zip(tokens, lengths, tables)]
        got = {name: model.forward_paged(items, pools[name], last_logits_only=True)
               for name, model in models.items()}
        lengths = [n + t.numel() for n, t in zip(lengths, tokens)]
        for i in range(len(prompts)):
            graph, plain, reference = got["gpu"][i][-1], got["eager"][i][-1], got["cpu"][i][-1]
            assert torch.allclose(graph, plain, atol=TOL[torch_dtype], rtol=0)
            assert torch.allclose(graph.cpu(), reference, atol=TOL[torch_dtype] * 10, rtol=TOL[torch_dtype])
    stats = gpu.graph_stats
    assert stats["captured"] == 1 and stats["replays"] == 3 and stats["eager"] == 2   # the prefill, step 2
    assert torch.allclose(pools["gpu"].float(), pools["eager"].float(), atol=TOL[torch_dtype], rtol=0)


def _engine(model, device, blocks=64, block_tokens=8):
    c = model.config
    cfg = TierConfig(hot_blocks=blocks, warm_blocks=blocks, cold_blocks=0, block_tokens=block_tokens, device=device)
    cache = TieredCache(cfg, KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, c.dtype))
    return Engine(model, cache, keep_logits=True)


# The same run on the CPU (its compiled kernel) keeps the test's own logic checked where CI runs.
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_engine_matches_the_reference_forward(device, request):
    if device == "cuda":
        request.getfixturevalue("kernel")
    model = _model("float32", device)
    engine = _engine(model, device)
    assert engine.cuda_graphs == (device == "cuda") and (engine.decode_kernel or device == "cpu")
    system = list(range(50, 110))
    reqs = [engine.submit(EngineRequest(system + [i, i + 1, i + 2], SamplingParams(max_tokens=6))) for i in range(5)]
    while engine.has_work():
        engine.step()
    assert [(r.error, len(r.output)) for r in reqs] == [(None, 6)] * 5
    follow = engine.submit(EngineRequest(reqs[0].prompt + reqs[0].output + [7, 8], SamplingParams(max_tokens=4)))
    while engine.has_work():
        engine.step()
    assert (follow.error, len(follow.output)) == (None, 4)
    assert follow.cached_tokens == len(reqs[0].prompt) + 6   # the whole first turn, its reply included
    for req in reqs + [follow]:
        tokens = req.prompt + req.output
        reference = forward_one(model, torch.tensor(tokens), 0, None)[0]
        got = torch.cat(req.logits, dim=0)
        start = req.cached_tokens
        assert torch.allclose(got, reference[start:start + got.shape[0]].to(got.device), atol=1e-4, rtol=0)
        assert req.output == reference[len(req.prompt) - 1:-1].argmax(dim=-1).tolist()
    if device == "cuda":
        assert model.graph_stats["replays"] >= 5 and model.graph_stats["capture_failures"] == 0
    engine.cache.check_invariants()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_warm_up_builds_every_bucket_before_the_first_step(device, request):
    """``cuda_graphs.warm_up`` (what a replica runs before it reports ready): on CUDA, Triton's
    eager variants compiled and a graph captured for every batch-size bucket, so serving
    captures nothing and its results are still the reference forward's; on the CPU nothing
    to do (its kernels are built with the engine)."""
    from cluster.engine.cuda_graphs import DEFAULT_SIZES, warm_up

    model = _model("float32", device)
    engine = _engine(model, device)
    pieces = []
    done = warm_up(model, run=lambda step: pieces.append(step) or step())
    if device == "cpu":
        assert done == {"steps": 0} and pieces == [] and model.graph_stats == {}
    else:
        request.getfixturevalue("kernel")
        assert len(pieces) == 2 + len(DEFAULT_SIZES)   # two eager steps, then one piece a bucket
        assert done["graphs_captured"] == list(DEFAULT_SIZES) and done["graph_capture_failures"] == 0
        assert done["triton_eager_steps"] == 2
        assert model.graph_stats["captured"] == len(DEFAULT_SIZES) and model.graph_stats["replays"] == 0
    reqs = [engine.submit(EngineRequest(list(range(20 + i, 60 + i)), SamplingParams(max_tokens=5))) for i in range(3)]
    while engine.has_work():
        engine.step()
    for req in reqs:
        reference = forward_one(model, torch.tensor(req.prompt + req.output), 0, None)[0]
        assert req.output == reference[len(req.prompt) - 1:-1].argmax(dim=-1).tolist()
    if device == "cuda":   # served from the graphs captured at start-up: none captured since
        assert model.graph_stats["captured"] == len(DEFAULT_SIZES) and model.graph_stats["replays"] >= 4
