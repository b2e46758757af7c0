"""``prefix-cache bench engine``: the packed engine against transformers on one model.

Both arms load the same checkpoint (the same safetensors files), run on the
same device, dtype and number of torch threads, and see the same prompts
(deterministic token ids drawn from the vocabulary, no special tokens). One
JSON row per arm:

- ``ttft_ms_cold``: a fresh prompt of ``--prompt-tokens``, prefill to first
  token (best of ``--repeats``; the arms are measured in turns, so load from
  elsewhere on the host hits both).
- ``ttft_ms_cached``: a prompt whose first ``prompt_tokens - suffix_tokens``
  tokens were served before (a multi-turn follow-up). The engine matches them
  in its radix tree; transformers prefills the prefix once and runs the
  suffix on a copy of that ``DynamicCache``, the prompt-reuse recipe of its
  documentation. The copy is made before its clock starts (``cache_copy_ms``
  says what it costs): a server can instead crop the cache back to the prefix
  after each request, so the copy is not a cost transformers must pay.
  ``cached_ttft_vs_transformers_cached`` divides transformers' cached TTFT by
  ours: prefix reuse against prefix reuse.
  ``cached_speedup_vs_transformers_prefill`` divides transformers' full
  prefill (its cold TTFT) by ours instead, which is what a transformers server
  without prefix reuse pays.
- ``decode_tokens_per_s``: batch 1, ``--max-tokens`` greedy tokens after the
  first.
- ``throughput_tokens_per_s``: ``--concurrency`` distinct prompts, generated
  tokens / wall time, prefill included. The engine runs them concurrently
  (continuous batching); transformers runs them one after another
  (``throughput_tokens_per_s``) and, in the same run, as one batched
  ``generate`` call (``throughput_tokens_per_s_batched``: equal prompt lengths
  need no padding, so this is transformers' best case).
- ``greedy_match``: the fraction of the concurrency prompts on which this
  arm's greedy tokens equal the other arm's, all ``--max-tokens`` of them (the
  engine's concurrent run against transformers' one-at-a-time ``generate``);
  ``greedy_token_match``: the share of the generated tokens that come before
  each prompt's first difference. The transformers line also has
  ``greedy_match_batched``: its batched ``generate`` against the engine.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import random
import time

import torch

from cluster.cache.kv_pool import KVLayout
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.engine.checkpoint import ModelSpec, load_model
from cluster.engine.engine import Engine, EngineRequest, SamplingParams
from cluster.errors import InvalidInputError
from lab.bench.common import emit, rounded


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the spec's, float32)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--suffix-tokens", type=int, default=32,
                   help="new tokens after the cached prefix for ttft_ms_cached (default 32)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--shared-prefix-tokens", type=int, default=0,
                   help="the concurrent prompts start with the same N tokens (a system prompt), computed "
                        "once beforehand by both arms: the engine holds it in its cache, transformers "
                        "copies its DynamicCache into each request (default 0: distinct prompts)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="TTFT samples per arm, taken in turns (best reported)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for both arms (default 1)")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--cuda-graphs", choices=("on", "off"), default="on",
                   help="on CUDA: decode steps replay a captured graph per batch-size bucket (default on)")
    p.add_argument("--seed", type=int, default=0)


def _prompts(vocab: int, count: int, length: int, seed: int, low: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, vocab) for _ in range(length)] for _ in range(count)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------ the engine arm
class EngineArm:
    def __init__(self, loaded, args, device: torch.device):
        model = loaded.model
        c = model.config
        per_request = args.prompt_tokens + args.max_tokens + 1
        # HOT holds every concurrent request plus the cached prefixes of the TTFT runs.
        hot_tokens = per_request * (args.concurrency + 2 * args.repeats + 4)
        cfg = TierConfig(hot_blocks=-(-hot_tokens // args.block_tokens) + 16, block_tokens=args.block_tokens,
                         device=str(device))
        cache = TieredCache(cfg, KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, c.dtype), vocab_size=c.vocab_size)
        self.engine = Engine(model, cache, max_batch_tokens=max(4096, args.prompt_tokens),
                             max_running=max(64, args.concurrency), cuda_graphs=args.cuda_graphs == "on")
        self.device = device

    def run(self, prompts: list[list[int]], max_tokens: int) -> list[EngineRequest]:
        reqs = [self.engine.submit(EngineRequest(list(p), SamplingParams(max_tokens=max_tokens))) for p in prompts]
        while not all(r.finished for r in reqs):
            self.engine.step()
        _sync(self.device)
        for r in reqs:
            if r.error:
                raise RuntimeError(f"engine request failed: {r.error}")
        return reqs

    def ttft_s(self, prompt: list[int]) -> tuple[float, int]:
        req = self.run([prompt], 1)[0]
        return req.first_token_at - req.submitted_at, req.cached_tokens

    def decode_tokens_per_s(self, prompt: list[int], max_tokens: int) -> float:
        req = self.engine.submit(EngineRequest(list(prompt), SamplingParams(max_tokens=max_tokens)))
        first = None
        while not req.finished:
            self.engine.step()
            if first is None and req.output:
                _sync(self.device)
                first = time.perf_counter()
        _sync(self.device)
        return (len(req.output) - 1) / (time.perf_counter() - first)


# ------------------------------------------------------------- the transformers arm
class TransformersArm:
    def __init__(self, checkpoint_dir, dtype: torch.dtype, device: torch.device):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(checkpoint_dir), dtype=dtype, local_files_only=True).to(device).eval()
        self.device = device
        self.cache_class = transformers.DynamicCache
        # transformers 5.x names the cache argument `cache`, 4.x `past_key_values`.
        self.cache_kwarg = "cache" if "cache" in inspect.signature(self.model.forward).parameters \
            else "past_key_values"

    def _forward(self, ids: torch.Tensor, cache, **kw):
        out = self.model(input_ids=ids, use_cache=True, **{self.cache_kwarg: cache}, **kw)
        return out, getattr(out, self.cache_kwarg)

    @torch.no_grad()
    def prefill(self, ids: list[int], cache=None, start: int = 0):
        x = torch.tensor([ids[start:]], device=self.device)
        out, cache = self._forward(x, cache if cache is not None else self.cache_class(), logits_to_keep=1)
        token = int(out.logits[0, -1].argmax())
        _sync(self.device)
        return token, cache

    @torch.no_grad()
    def generate(self, batch: list[list[int]], max_tokens: int, prefix_cache=None) -> list[list[int]]:
        x = torch.tensor(batch, device=self.device)
        extra = {}
        if prefix_cache is not None:   # the documented prompt-reuse recipe: a copy per request
            extra[self.cache_kwarg] = copy.deepcopy(prefix_cache)
        out = self.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                  max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0, **extra)
        _sync(self.device)
        return [row[len(batch[0]):].tolist() for row in out]

    def ttft_s(self, ids: list[int]) -> float:
        t0 = time.perf_counter()
        self.prefill(ids)
        return time.perf_counter() - t0

    def cached_ttft_s(self, prefix_cache, ids: list[int], prefix_len: int) -> tuple[float, float]:
        """Seconds to the first token of ``ids`` on a copy of ``prefix_cache``, and
        seconds the copy took (made before the clock starts; see the module doc)."""
        t0 = time.perf_counter()
        cache = copy.deepcopy(prefix_cache)
        _sync(self.device)
        t1 = time.perf_counter()
        self.prefill(ids, cache, start=prefix_len)
        return time.perf_counter() - t1, t1 - t0

    @torch.no_grad()
    def decode_tokens_per_s(self, ids: list[int], max_tokens: int) -> float:
        token, cache = self.prefill(ids)
        t0 = time.perf_counter()
        for _ in range(max_tokens - 1):
            out, cache = self._forward(torch.tensor([[token]], device=self.device), cache)
            token = int(out.logits[0, -1].argmax())
        _sync(self.device)
        return (max_tokens - 1) / (time.perf_counter() - t0)


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    spec = ModelSpec.parse(args.model)
    if args.dtype:
        spec = dataclasses.replace(spec, dtype=args.dtype)
    loaded = load_model(spec, device=str(device))
    if loaded.checkpoint_dir is None:
        raise InvalidInputError("bench engine compares against transformers: give --model a real checkpoint "
                                "(the default, a local directory, a GGUF file or a hub id), not 'builtin'")
    c = loaded.model.config
    low = 1 + max(loaded.eos_token_ids, default=0)   # keep special tokens out of the prompts
    n_ttft = args.repeats
    prompts = _prompts(c.vocab_size, 2 * n_ttft + args.concurrency + 1, args.prompt_tokens, args.seed, low)
    cold_prompts, cached_prompts = prompts[:n_ttft], prompts[n_ttft:2 * n_ttft]
    batch_prompts, decode_prompt = prompts[2 * n_ttft:-1], prompts[-1]
    shared = args.shared_prefix_tokens
    if shared:
        batch_prompts = [batch_prompts[0][:shared] + p[shared:] for p in batch_prompts]
    prefix_len = args.prompt_tokens - args.suffix_tokens
    common = {"bench": "engine", "model": loaded.model_id, "dtype": c.dtype, "device": str(device),
              "threads": args.threads, "prompt_tokens": args.prompt_tokens, "cached_prefix_tokens": prefix_len,
              "shared_prefix_tokens": shared,
              "concurrency": args.concurrency, "max_tokens": args.max_tokens}

    # Both arms are loaded side by side and measured in turns (ours, then transformers, per
    # sample), so a burst of other load on the machine hits both; TTFT is the best of the
    # samples and decode the best of two runs, the usual way to time on a shared host.
    ours = EngineArm(loaded, args, device)
    hf = TransformersArm(loaded.checkpoint_dir, loaded.model.config.torch_dtype, device)
    warm = _prompts(c.vocab_size, 1, 64, args.seed + 1, low)[0]
    ours.run([warm], 2)
    hf.prefill(warm)
    m = _Measured()
    _measure_ttft(m, ours, hf, cold_prompts, cached_prompts, prefix_len, args.block_tokens)
    for _ in range(2):
        m.decode = max(m.decode, ours.decode_tokens_per_s(decode_prompt, args.max_tokens))
        m.hf_decode = max(m.hf_decode, hf.decode_tokens_per_s(decode_prompt, args.max_tokens))
    _measure_batch(m, ours, hf, batch_prompts, shared, args)
    emit(_ours_row(common, m, ours, loaded))
    emit(_transformers_row(common, m))
    return 0


def _check_args(args: argparse.Namespace) -> None:
    for name in ("prompt_tokens", "concurrency", "max_tokens", "repeats", "threads", "block_tokens"):
        if getattr(args, name) < 1:
            raise InvalidInputError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_tokens < 2:
        raise InvalidInputError("--max-tokens must be >= 2 (decode speed is measured after the first token)")
    if not 0 <= args.shared_prefix_tokens < args.prompt_tokens:
        raise InvalidInputError("--shared-prefix-tokens must be in [0, --prompt-tokens)")
    if not 0 < args.suffix_tokens < args.prompt_tokens:
        raise InvalidInputError("--suffix-tokens must be in [1, --prompt-tokens)")


@dataclasses.dataclass
class _Measured:
    """Both arms' samples: TTFT seconds per prompt, decode tokens/s, the concurrent batch."""
    cold: list[float] = dataclasses.field(default_factory=list)
    hf_cold: list[float] = dataclasses.field(default_factory=list)
    cached: list[float] = dataclasses.field(default_factory=list)
    hf_cached: list[float] = dataclasses.field(default_factory=list)
    hf_copy: list[float] = dataclasses.field(default_factory=list)
    decode: float = 0.0
    hf_decode: float = 0.0
    throughput: float = 0.0
    hf_sequential: float = 0.0
    hf_batched: float = 0.0
    outputs: list = dataclasses.field(default_factory=list)
    hf_outputs: list = dataclasses.field(default_factory=list)
    hf_batched_outputs: list = dataclasses.field(default_factory=list)


def _measure_ttft(m: _Measured, ours: EngineArm, hf: TransformersArm, cold_prompts: list[list[int]],
                  cached_prompts: list[list[int]], prefix_len: int, block_tokens: int) -> None:
    for p in cold_prompts:
        m.cold.append(ours.ttft_s(p)[0])
        m.hf_cold.append(hf.ttft_s(p))
    for p in cached_prompts:
        ours.run([p[:prefix_len]], 1)                   # an earlier turn leaves the prefix cached
        seconds, hit = ours.ttft_s(p)
        if hit < prefix_len - block_tokens:
            raise RuntimeError(f"expected a cache hit of ~{prefix_len} tokens, got {hit}")
        m.cached.append(seconds)
        _, prefix_cache = hf.prefill(p[:prefix_len])
        seconds, copy_seconds = hf.cached_ttft_s(prefix_cache, p, prefix_len)
        m.hf_cached.append(seconds)
        m.hf_copy.append(copy_seconds)


def _measure_batch(m: _Measured, ours: EngineArm, hf: TransformersArm, batch_prompts: list[list[int]],
                   shared: int, args: argparse.Namespace) -> None:
    """The concurrent prompts: ours in one engine, transformers one by one and batched."""
    if shared:
        ours.run([batch_prompts[0][:shared]], 1)       # the system prompt, served before
    t0 = time.perf_counter()
    reqs = ours.run(batch_prompts, args.max_tokens)
    m.throughput = sum(len(r.output) for r in reqs) / (time.perf_counter() - t0)
    m.outputs = [r.output for r in reqs]
    prefix_cache = hf.prefill(batch_prompts[0][:shared])[1] if shared else None
    t0 = time.perf_counter()
    m.hf_outputs = [hf.generate([p], args.max_tokens, prefix_cache)[0] for p in batch_prompts]
    m.hf_sequential = args.concurrency * args.max_tokens / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    m.hf_batched_outputs = hf.generate(batch_prompts, args.max_tokens, _batched(prefix_cache, args.concurrency))
    m.hf_batched = args.concurrency * args.max_tokens / (time.perf_counter() - t0)


def _ours_row(common: dict, m: _Measured, ours: EngineArm, loaded) -> dict:
    match, token_match = greedy_agreement(m.outputs, m.hf_outputs)
    hf_cold_ms = min(m.hf_cold) * 1e3
    hf_cached_ms = min(m.hf_cached) * 1e3
    row = {**common, "impl": "prefix-cache",
           "ttft_ms_cold": rounded(min(m.cold) * 1e3, 1),
           "ttft_ms_cached": rounded(min(m.cached) * 1e3, 1),
           "decode_tokens_per_s": rounded(m.decode, 2),
           "throughput_tokens_per_s": rounded(m.throughput, 2),
           "greedy_match": rounded(match, 4),
           "greedy_token_match": rounded(token_match, 4),
           "decode_kernel": bool(ours.engine.decode_kernel), "cuda_graphs": bool(ours.engine.cuda_graphs),
           "graph_replays": getattr(loaded.model, "graph_stats", {}).get("replays", 0)}
    row["cold_ttft_vs_transformers"] = rounded(row["ttft_ms_cold"] / hf_cold_ms, 3)
    row["decode_vs_transformers"] = rounded(m.decode / m.hf_decode, 3)
    row["throughput_vs_transformers_sequential"] = rounded(m.throughput / m.hf_sequential, 2)
    row["throughput_vs_transformers_batched"] = rounded(m.throughput / m.hf_batched, 2)
    row["cached_speedup_vs_transformers_prefill"] = rounded(hf_cold_ms / row["ttft_ms_cached"], 1)
    # From the printed TTFTs, so a reader gets the same ratio from the two lines.
    row["cached_ttft_vs_transformers_cached"] = rounded(rounded(hf_cached_ms, 1) / row["ttft_ms_cached"], 2)
    return row


def _transformers_row(common: dict, m: _Measured) -> dict:
    hf_match, hf_token_match = greedy_agreement(m.hf_outputs, m.outputs)
    hf_match_batched, _ = greedy_agreement(m.hf_batched_outputs, m.outputs)
    return {**common, "impl": "transformers", "version": _transformers_version(),
            "ttft_ms_cold": rounded(min(m.hf_cold) * 1e3, 1),
            "ttft_ms_cached": rounded(min(m.hf_cached) * 1e3, 1),
            "cache_copy_ms": rounded(min(m.hf_copy) * 1e3, 1),
            "decode_tokens_per_s": rounded(m.hf_decode, 2),
            "throughput_tokens_per_s": rounded(m.hf_sequential, 2),
            "throughput_tokens_per_s_batched": rounded(m.hf_batched, 2),
            "greedy_match": rounded(hf_match, 4),
            "greedy_token_match": rounded(hf_token_match, 4),
            "greedy_match_batched": rounded(hf_match_batched, 4)}


def greedy_agreement(outputs: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(share of prompts whose tokens all equal the reference's, share of the
    reference's tokens that come before the prompt's first difference).

    Tokens after a difference are not compared: each continues a different
    sequence, so agreeing there again would be chance."""
    if len(outputs) != len(reference) or not reference:
        raise ValueError(f"compare the same prompts: {len(outputs)} outputs against {len(reference)}")
    exact = agreed = total = 0
    for out, ref in zip(outputs, reference):
        same = 0
        for a, b in zip(out, ref):
            if a != b:
                break
            same += 1
        exact += out == ref
        agreed += same
        total += len(ref)
    return exact / len(reference), (agreed / total if total else 1.0)


def _batched(cache, batch: int):
    """A prefix cache repeated along the batch dimension, for batched generate."""
    if cache is None:
        return None
    cache = copy.deepcopy(cache)
    cache.batch_repeat_interleave(batch)
    return cache


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
