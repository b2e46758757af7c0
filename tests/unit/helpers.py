"""Shared test helpers (plain code, imported by the unit tests)."""


class TickClock:
    """Injectable time that advances one unit a call, so LRU order in tests is exact."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1.0
        return self.t


# A small seeded model and a worker around it, for the WorkerCore tests (no Ray).
WORKER_MODEL = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                    seed=5)


def make_worker(worker_id, peer_host=None, peer_secret=None, **kw):
    """A WorkerCore on the small model; ``kw`` are worker config keys, ``peer_host`` opens its peer channel."""
    from actors.core import WorkerConfig, WorkerCore

    cfg = WorkerConfig.from_dict(dict(model=WORKER_MODEL, hot_blocks=128, warm_blocks=128, block_tokens=16, **kw))
    return WorkerCore(worker_id, cfg, peer_host=peer_host, peer_secret=peer_secret)


def run_worker(core, prompt, max_tokens=4):
    """Every item of one request on ``core``, run to its end."""
    import asyncio

    from cluster.protocol import GenerateRequest, SamplingParams

    async def go():
        return [item async for item in core.generate(GenerateRequest(prompt, SamplingParams(max_tokens=max_tokens)))]
    return asyncio.run(go())


def greedy_reference(prompt, n, model_config=None):
    """``n`` greedy tokens after ``prompt`` by full prefills of the seeded model (no cache)."""
    import torch

    from cluster.engine.model import DecoderModel, ModelConfig
    from tests.unit.reference_forward import forward_one

    model = DecoderModel(ModelConfig(**(model_config or WORKER_MODEL)))
    toks = list(prompt)
    for _ in range(n):
        toks.append(int(forward_one(model, torch.tensor(toks), 0, None)[0][-1].argmax()))
    return toks[len(prompt):]


def require_compiled(built, name: str):
    """A compiled kernel (module or function) ``built``; where ``name``'s module could not be
    built here (no compiler, ``PREFIX_CACHE_KERNELS=0``) the test fails under CI and skips
    elsewhere (``tests.requirements``)."""
    from tests.requirements import require_kernel

    return require_kernel(built, name)


def tune_blocked(model, monkeypatch, tmp_path) -> dict:
    """``model.tune_linears()`` into a fresh tuning directory with the blocked layout timed
    fastest at every row count (its result); skips where no summation order of MKL's is
    found on this machine (the layout is then never used)."""
    import pytest

    from cluster.engine import linear_layouts

    monkeypatch.setenv(linear_layouts.TUNING_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(linear_layouts, "_known", {})
    monkeypatch.setattr(linear_layouts, "_time", lambda weights, rows, layout, packs, **_:
                        -1.0 if layout == linear_layouts.BLOCKED else float(layout))
    tuned = model.tune_linears()
    if linear_layouts.BLOCKED not in model.kernels.layer_layouts:
        pytest.skip("no summation order of MKL's found on this machine")
    return tuned
