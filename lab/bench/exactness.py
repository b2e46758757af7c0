"""``prefix-cache bench exactness``: the engine's logits against transformers' on a long real prompt.

One model, loaded twice from the same checkpoint (the packed engine, and transformers'
own model on the same device and dtype), and three requests through the engine, each of
whose computed positions is compared with transformers' forward of the same tokens:

- ``cold``: ``--prompt-tokens`` tokens of real text (default: this package's own module
  docstrings; ``--text FILE`` for others), prefilled in chunks of ``--max-batch-tokens``,
  then ``--max-tokens`` greedy decodes;
- ``cached``: a prompt of the same length whose first ``--shared-tokens`` are the first
  prompt's (a cache hit) and whose rest is other text;
- ``later``: the first prompt and its reply and ``--later-tokens`` more (a later turn:
  a few tokens after a long cached prefix, which the batched attention kernel attends).

One JSON row: per request the cached tokens, the positions compared and the largest
absolute difference of a logit; the largest over all (``max_abs_diff``) against
``--tolerance`` (1e-4 in float32; in other dtypes none unless given: reported, not
checked); the greedy agreement (``greedy_tokens_agree``: the engine's sampled tokens that
are transformers' argmax at the same position, the context being the same); which
compiled parts ran (on the CPU the calls of the batched attention kernel, the compiled
norms and rotary embedding and the compiled layer loop; on CUDA the decode graphs
captured at start-up, replayed, and captured while serving, which should be none).
Exit status 1 when a tolerance is set and exceeded.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any, Iterator

import torch

import cluster
from cluster.cache.kv_pool import KVLayout
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.engine import cuda_graphs
from cluster.engine.checkpoint import ModelSpec, load_model, load_tokenizer
from cluster.engine.engine import Engine, EngineRequest, SamplingParams
from cluster.errors import InvalidInputError
from lab.bench.common import emit, rounded

FLOAT32_TOLERANCE = 1e-4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default float32)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    p.add_argument("--prompt-tokens", type=int, default=1100)
    p.add_argument("--shared-tokens", type=int, default=900,
                   help="the cached request's prefix shared with the first prompt (default 900)")
    p.add_argument("--later-tokens", type=int, default=16, help="the later turn's new tokens (default 16)")
    p.add_argument("--max-tokens", type=int, default=8, help="greedy tokens each request decodes (default 8)")
    p.add_argument("--tolerance", type=float, default=None,
                   help=f"largest logit difference allowed (default {FLOAT32_TOLERANCE:g} in float32; "
                        f"none in other dtypes: reported, not checked)")
    p.add_argument("--text", default=None, help="a UTF-8 text file for the prompts (default: this package's "
                                                "module docstrings)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--max-batch-tokens", type=int, default=512)


def package_text() -> str:
    """The product library's module docstrings (``cluster/``), in path order: real English
    prose that every installation has (read from the sources, nothing imported)."""
    root = Path(cluster.__file__).resolve().parent
    docs = []
    for path in sorted(root.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        if doc:
            docs.append(doc)
    return "\n\n".join(docs)


@dataclasses.dataclass(frozen=True)
class Prompts:
    first: list[int]
    cached: list[int]    # the first one's first shared tokens, then other text
    later: list[int]     # the later turn's new tokens (after the first prompt and its reply)


def make_prompts(tokens: list[int], prompt_tokens: int, shared_tokens: int, later_tokens: int) -> Prompts:
    """The three prompts from one long token sequence of text (see the module doc)."""
    if not 0 < shared_tokens < prompt_tokens:
        raise InvalidInputError(f"shared tokens must be in [1, {prompt_tokens}), got {shared_tokens}")
    if later_tokens < 1:
        raise InvalidInputError(f"later tokens must be >= 1, got {later_tokens}")
    first = tokens[:prompt_tokens]
    rest = prompt_tokens - shared_tokens
    # The cached prompt's own part: other text, starting with a token other than the first
    # prompt's at that position, so the hit is exactly the shared tokens.
    start = next((i for i in range(prompt_tokens, len(tokens)) if tokens[i] != first[shared_tokens]), len(tokens))
    own = tokens[start:start + rest]
    later = tokens[start + rest:start + rest + later_tokens]
    if len(own) < rest or len(later) < later_tokens:
        raise InvalidInputError(f"the text has {len(tokens)} tokens: too few for a {prompt_tokens}-token prompt, "
                                f"{rest} more and {later_tokens} for the later turn")
    return Prompts(first, first[:shared_tokens] + own, later)


def make_engine(model: Any, device: torch.device, tokens: int, block_tokens: int, max_batch_tokens: int) -> Engine:
    """An engine whose HOT pool holds ``tokens`` with room to spare (nothing is evicted)."""
    c = model.config
    cfg = TierConfig(hot_blocks=-(-2 * tokens // block_tokens) + 8, block_tokens=block_tokens, device=str(device))
    cache = TieredCache(cfg, KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, c.dtype), vocab_size=c.vocab_size)
    return Engine(model, cache, keep_logits=True, max_batch_tokens=max_batch_tokens)


def _run(engine: Engine, prompt: list[int], max_tokens: int) -> EngineRequest:
    req = engine.submit(EngineRequest(list(prompt), SamplingParams(max_tokens=max_tokens)))
    while not req.finished:
        engine.step()
    if req.error:
        raise RuntimeError(f"engine request failed: {req.error}")
    return req


@contextlib.contextmanager
def counted_kernels(model: Any) -> Iterator[dict[str, int]]:
    """Counts, while the block runs, the calls of the CPU model's compiled parts: the batched
    attention kernel over the pool's slots (``paged_attention``, per layer of a step the
    Python loop runs; ``extend_attention``, the key this count had when the kernel attended
    per-request buffers, kept equal to it for readers of the JSON), the compiled norms and
    rotary embedding (``small_ops``), the layer loop in one call (``layer_loop``, per
    step) and a prompt chunk's attention (``prefill_attention``, per layer of a chunk).
    Nothing is counted on CUDA (see the graph figures)."""
    counts = {"paged_attention": 0, "extend_attention": 0, "small_ops": 0, "layer_loop": 0, "prefill_attention": 0}
    saved = (model.kernels.attention, model.kernels.small_ops, model.kernels.layer_loop, model.kernels.prefill)

    def counting(names: tuple[str, ...], fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            for name in names:
                counts[name] += 1
            return fn(*args, **kwargs)
        return call

    if model.device.type == "cpu":
        if saved[0] is not None:
            model.kernels.attention = counting(("paged_attention", "extend_attention"), saved[0])
        if saved[1] is not None:
            model.kernels.small_ops = _CountedOps(saved[1], counting)
        if saved[2] is not None:
            model.kernels.layer_loop = counting(("layer_loop",), saved[2])
        if saved[3] is not None:
            model.kernels.prefill = counting(("prefill_attention",), saved[3])
    try:
        yield counts
    finally:
        model.kernels.attention, model.kernels.small_ops, model.kernels.layer_loop, model.kernels.prefill = saved


class _CountedOps:
    """The compiled small-ops module with each function it hands out counted."""

    def __init__(self, module: Any, counting: Any):
        self._module, self._counting = module, counting

    def __getattr__(self, name: str) -> Any:
        return self._counting(("small_ops",), getattr(self._module, name))


def _hf_logits(hf_model: Any, tokens: list[int], device: torch.device) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor([tokens], device=device)).logits[0].float()


def _case(req: EngineRequest, reference: torch.Tensor) -> dict[str, Any]:
    """One request's computed positions (kept logits) against the reference of its tokens."""
    got = torch.cat(req.logits, dim=0).float()
    start = req.cached_tokens
    want = reference[start:start + got.shape[0]].to(got.device)
    if got.shape[0] != len(req.prompt) - start + len(req.output) - 1 or want.shape != got.shape:
        raise RuntimeError(f"kept {got.shape[0]} positions of logits, expected "
                           f"{len(req.prompt) - start + len(req.output) - 1}")
    # Each sampled token against transformers' argmax after the same tokens.
    sampled = reference[len(req.prompt) - 1:len(req.prompt) - 1 + len(req.output)].argmax(dim=-1).tolist()
    return {"prompt_tokens": len(req.prompt), "cached_tokens": start, "positions": got.shape[0],
            "max_abs_diff": float((got - want).abs().max()),
            "argmax_agree": int((got.argmax(dim=-1) == want.argmax(dim=-1)).sum()),
            "greedy_agree": sum(a == b for a, b in zip(req.output, sampled)), "greedy_tokens": len(req.output)}


def compare(engine: Engine, hf_model: Any, prompts: Prompts, max_tokens: int) -> dict[str, Any]:
    """The three requests through ``engine`` (a fresh one: nothing cached) against ``hf_model``
    on the same device; per request its ``_case`` and the compiled parts' call counts."""
    model = engine.model
    device = model.device
    with counted_kernels(model) as calls:
        first = _run(engine, prompts.first, max_tokens)
        cached = _run(engine, prompts.cached, max_tokens)
        later = _run(engine, first.prompt + first.output + prompts.later, max_tokens)
    # The later turn's tokens extend the first request's: one forward is the reference of both.
    whole = _hf_logits(hf_model, later.prompt + later.output, device)
    cases = {"cold": _case(first, whole), "later": _case(later, whole)}
    cases["cached"] = _case(cached, _hf_logits(hf_model, cached.prompt + cached.output, device))
    return {"cases": {name: cases[name] for name in ("cold", "cached", "later")}, "kernel_calls": calls}


def run(args: argparse.Namespace) -> int:
    for name in ("prompt_tokens", "max_tokens", "block_tokens", "max_batch_tokens"):
        if getattr(args, name) < 1:
            raise InvalidInputError(f"--{name.replace('_', '-')} must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    spec = dataclasses.replace(ModelSpec.parse(args.model), dtype=args.dtype)
    began = time.perf_counter()
    loaded = load_model(spec, device=str(device))
    if loaded.checkpoint_dir is None:
        raise InvalidInputError("bench exactness compares against transformers: give --model a real checkpoint "
                                "(the default, a local directory, a GGUF file or a hub id), not 'builtin'")
    import transformers

    model = loaded.model
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(loaded.checkpoint_dir), dtype=model.config.torch_dtype, local_files_only=True).to(device).eval()
    text = Path(args.text).read_text(encoding="utf-8") if args.text else package_text()
    tokens = load_tokenizer(loaded).encode(text)
    prompts = make_prompts(tokens, args.prompt_tokens, args.shared_tokens, args.later_tokens)
    engine = make_engine(model, device, 2 * args.prompt_tokens + args.later_tokens + 3 * args.max_tokens,
                         args.block_tokens, args.max_batch_tokens)
    warmed = cuda_graphs.warm_up(model)   # what a replica builds before it serves (nothing on the CPU)
    captured_before = model.graph_stats.get("captured", 0)
    result = compare(engine, hf_model, prompts, args.max_tokens)
    cases = result["cases"]
    tolerance = args.tolerance if args.tolerance is not None else \
        (FLOAT32_TOLERANCE if model.config.dtype == "float32" else None)
    worst = max(case["max_abs_diff"] for case in cases.values())
    graphs = model.graph_stats
    row = {"bench": "exactness", "model": loaded.model_id, "dtype": model.config.dtype, "device": str(device),
           "prompt_tokens": args.prompt_tokens, "shared_tokens": args.shared_tokens,
           "later_tokens": args.later_tokens, "max_tokens": args.max_tokens,
           **{f"{name}_{key}": (rounded(value, 7) if key == "max_abs_diff" else value)
              for name, case in cases.items() for key, value in case.items()},
           "max_abs_diff": rounded(worst, 7), "tolerance": tolerance,
           "within_tolerance": None if tolerance is None else worst <= tolerance,
           "greedy_tokens_agree": rounded(sum(c["greedy_agree"] for c in cases.values()) /
                                          sum(c["greedy_tokens"] for c in cases.values()), 4),
           "argmax_agree": rounded(sum(c["argmax_agree"] for c in cases.values()) /
                                   sum(c["positions"] for c in cases.values()), 4),
           "decode_kernel": bool(engine.decode_kernel), "kernel_calls": result["kernel_calls"],
           "linear_layouts": sorted({name for group in engine.linear_layouts.values() for name in group.values()}),
           "cuda_graphs": bool(engine.cuda_graphs), "graphs_captured_at_start": captured_before,
           "graphs_captured_while_serving": graphs.get("captured", 0) - captured_before,
           "graph_replays": graphs.get("replays", 0), "warm_up_steps": warmed["steps"],
           "seconds": rounded(time.perf_counter() - began, 1)}
    emit(row)
    return 0 if row["within_tolerance"] in (None, True) else 1
