"""The parts of ``prefix-cache bench codec`` that run in one process (no Ray, no HTTP).

Each part compares the tier codecs (``none`` and ``int8``) in the same run and
returns one JSON row (``lab.bench.codec`` prints them, with lm-eval):

- ``bytes``: bytes per token of each tier (HOT in the model's dtype; WARM, COLD
  and an L3 value, header and tokens included, in each codec's stored format);
- ``sessions_held``: long sessions (a shared system prompt and each session's own
  document) committed one after another into a fixed WARM budget (``--warm-mb``;
  no COLD), pushed down from HOT; how many are still whole in the tiers at the end;
  also against a bfloat16 model's uncompressed WARM;
- ``promotion``: the time to promote a ``--promote-tokens`` prefix from WARM and
  from COLD (OS page cache dropped first) back to HOT, per token, median of
  ``--repeats``, the arms interleaved;
- ``accuracy``: the default model's next-token logprobs of ``--positions``
  positions of real text computed after a prefix promoted from WARM, against the
  same run with uncompressed tiers: largest and mean |delta|, argmax agreement;
- ``greedy``: ``--greedy-prompts`` prompts of real text cached, pushed to WARM,
  sent again and decoded greedily for ``--greedy-tokens``: prompts whose tokens
  all agree with the uncompressed run;
- ``workload``: issue 39's long-session workload (``multiturn.run_policy``: real
  engine and model, simulated clock, the session prefetched on arrival as the
  ingress does) with HOT of 4,096 tokens and WARM at today's bytes and a quarter
  of them, per codec: later-turn cached share and TTFT p50/p99.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any, Sequence

import torch

from cluster.cache.codec import make_codec, stored_block_bytes
from cluster.cache.kv_pool import KVLayout
from cluster.cache.l3.wire import L3Block, encode_block, l3_key
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.engine.engine import Engine, EngineRequest, SamplingParams
from cluster.names import COLD, WARM
from lab.bench.common import rounded

TODAY_WARM_BLOCKS = 4096   # the worker's default WARM (actors.config.DEFAULT_TIERS), float32


def layout_of(model: Any, dtype: str | None = None) -> KVLayout:
    c = model.config
    return KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, dtype or c.dtype)


def _cfg(layout: KVLayout, codec: str, bt: int) -> TierConfig:
    return TierConfig(hot_blocks=1, block_tokens=bt, tier_codec=codec, device="cpu")


# ------------------------------------------------------------------------ bytes
def bytes_part(layout: KVLayout, codecs: Sequence[str], bt: int) -> dict:
    row: dict[str, Any] = {"part": "bytes", "model_dtype": layout.dtype, "block_tokens": bt,
                           "hot_bytes_per_token": layout.bytes_per_token()}
    for name in codecs:
        codec = make_codec(name, layout.torch_dtype, layout.head_dim)
        per_block = stored_block_bytes(codec, layout, _cfg(layout, name, bt))
        block = torch.zeros(layout.num_layers, 2, bt, layout.num_kv_heads, codec.stored_row, dtype=codec.stored_dtype)
        value = encode_block(L3Block(l3_key("m", "v", 0), tuple(range(bt)), block))
        row[f"{name}_warm_bytes_per_token"] = per_block / bt
        row[f"{name}_cold_bytes_per_token"] = per_block / bt
        row[f"{name}_l3_bytes_per_token"] = rounded(len(value) / bt, 1)
    for name in codecs:
        if name != "none" and "none" in codecs:
            row[f"{name}_warm_vs_none"] = rounded(row["none_warm_bytes_per_token"] / row[f"{name}_warm_bytes_per_token"], 3)
    return row


# --------------------------------------------------------------- sessions held
def _commit(cache: TieredCache, tokens: list[int], kv: torch.Tensor) -> None:
    lease = cache.admit(tokens, compute_last=False)
    try:
        have = lease.cached_tokens
        if have < len(tokens):
            lease.append(kv[:, :, have:len(tokens)])
            lease.commit(tokens)
    finally:
        lease.release()


def sessions_held(layout: KVLayout, codec: str, warm_mb: float, sessions: list[list[int]], bt: int) -> dict:
    """Commit ``sessions`` one after another (each pushed down to WARM at once), with a
    WARM of ``warm_mb`` MiB and no COLD; how many are whole in the tiers at the end."""
    longest = max(len(s) for s in sessions)
    cfg = TierConfig(hot_blocks=2 * (-(-longest // bt)) + 8, warm_mb=warm_mb, block_tokens=bt, device="cpu",
                     tier_codec=codec)
    cache = TieredCache(cfg, layout, deterministic_io=True)
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(layout.num_layers, 2, longest, layout.num_kv_heads, layout.head_dim, generator=g)
    kv = kv.to(layout.torch_dtype)   # the values do not matter here, only the bytes
    try:
        for tokens in sessions:
            _commit(cache, tokens, kv)
            cache.demote_path(tokens, tier=WARM)
        held = sum(1 for tokens in sessions if sum(cache.lookup(tokens).tier_lengths) == len(tokens))
        return {"warm_blocks": cache.config.warm_blocks, "warm_block_bytes": cache.pools[WARM].block_bytes,
                "sessions_held": held, "dropped_tokens": cache.stats["dropped_tokens"]}
    finally:
        cache.close()


def sessions_held_part(layout: KVLayout, codecs: Sequence[str], args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    system = [rng.randrange(1000, 30000) for _ in range(args.system_tokens)]
    per_warm = args.warm_mb * (1 << 20) / (args.doc_tokens * layout.num_layers * 2 * layout.num_kv_heads *
                                          (layout.head_dim + 1))
    count = int(per_warm) + 4   # more than the most compact codec holds
    sessions = [system + [rng.randrange(1000, 30000) for _ in range(args.doc_tokens)] for _ in range(count)]
    row: dict[str, Any] = {"part": "sessions_held", "warm_mb": args.warm_mb, "session_tokens": len(sessions[0]),
                           "sessions_committed": count}
    arms = [(name, layout) for name in codecs]
    if layout.dtype == "float32":
        arms.append(("none", KVLayout(layout.num_layers, layout.num_kv_heads, layout.head_dim, "bfloat16")))
    for name, lay in arms:
        key = name if lay is layout else f"{name}_{lay.dtype}"
        for k, v in sessions_held(lay, name, args.warm_mb, sessions, args.block_tokens).items():
            row[f"{key}_{k}"] = v
    for name in codecs:
        if name != "none" and "none" in codecs:
            row[f"{name}_vs_none"] = rounded(row[f"{name}_sessions_held"] / max(1, row["none_sessions_held"]), 3)
            if "none_bfloat16_sessions_held" in row:
                row[f"{name}_vs_none_bfloat16"] = rounded(
                    row[f"{name}_sessions_held"] / max(1, row["none_bfloat16_sessions_held"]), 3)
    return row


# ------------------------------------------------------------------- promotion
def promotion_part(layout: KVLayout, codecs: Sequence[str], args: argparse.Namespace, disk_dir: str) -> list[dict]:
    n, bt = args.promote_tokens, args.block_tokens
    blocks = -(-n // bt) + 8
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(layout.num_layers, 2, n, layout.num_kv_heads, layout.head_dim, generator=g).to(layout.torch_dtype)
    tokens = list(range(1, n + 1))
    caches = {}
    for name in codecs:
        cfg = TierConfig(hot_blocks=blocks, warm_blocks=blocks, cold_blocks=blocks, block_tokens=bt, device="cpu",
                         disk_dir=disk_dir, tier_codec=name)
        caches[name] = TieredCache(cfg, layout)
        _commit(caches[name], tokens, kv)
    times: dict[tuple[str, int], list[float]] = {(c, t): [] for c in codecs for t in (WARM, COLD)}
    try:
        for _ in range(args.repeats):
            for tier in (WARM, COLD):
                for name in codecs:   # interleaved: the arms share the machine's weather
                    cache = caches[name]
                    cache.demote_path(tokens, tier=tier)
                    cache.wait_all()
                    if tier == COLD:
                        cache.drop_page_cache()
                    began = time.perf_counter()
                    lease = cache.admit(tokens, compute_last=False)
                    took = time.perf_counter() - began
                    assert lease.cached_tokens == n and lease.promoted_tokens == n, "the promotion must bring all"
                    lease.release()
                    times[(name, tier)].append(took / n)
    finally:
        for cache in caches.values():
            cache.close()
    rows = []
    for tier, label in ((WARM, "warm"), (COLD, "cold")):
        row: dict[str, Any] = {"part": "promotion", "from": label, "tokens": n, "repeats": args.repeats}
        for name in codecs:
            row[f"{name}_us_per_token"] = rounded(statistics.median(times[(name, tier)]) * 1e6, 3)
        for name in codecs:
            if name != "none" and "none" in codecs:
                row[f"{name}_vs_none"] = rounded(row[f"{name}_us_per_token"] / row["none_us_per_token"], 3)
        rows.append(row)
    return rows


# -------------------------------------------------------------------- accuracy
def _engine(model: Any, codec: str, tokens: int, bt: int, max_batch_tokens: int) -> Engine:
    blocks = -(-2 * tokens // bt) + 16
    cfg = TierConfig(hot_blocks=blocks, warm_blocks=blocks, block_tokens=bt, device=str(model.device),
                     tier_codec=codec)
    cache = TieredCache(cfg, layout_of(model), vocab_size=model.config.vocab_size)
    return Engine(model, cache, keep_logits=True, max_batch_tokens=max_batch_tokens)


def _run_all(engine: Engine, prompts: Sequence[list[int]], max_tokens: int) -> list:
    reqs = [engine.submit(EngineRequest(list(p), SamplingParams(max_tokens=max_tokens))) for p in prompts]
    while not all(r.finished for r in reqs):
        engine.step()
    engine.complete_finished()
    bad = [r.error for r in reqs if r.error]
    if bad:
        raise RuntimeError(f"engine requests failed: {bad[:3]}")
    return reqs


def _through_warm(engine: Engine, prompts: Sequence[list[int]], later: Sequence[list[int]], max_tokens: int) -> list:
    """Cache each prompt, push its KV down to WARM, then run ``later`` (each starting with
    its prompt): their cached prefixes are promoted out of WARM."""
    for r in _run_all(engine, prompts, 1):   # the whole committed path: a frontier moves down first
        engine.cache.demote_path(list(r.prompt) + list(r.output), tier=WARM)
    reqs = _run_all(engine, later, max_tokens)
    warm = sum(r.tier_hits[WARM] for r in reqs)
    if warm < sum(len(p) for p in prompts) // 2:
        raise RuntimeError(f"the later requests found {warm} tokens in WARM of their {sum(map(len, prompts))}: "
                           "the comparison would not be of promoted prefixes")
    return reqs


def warm_share(reqs: Sequence[Any]) -> float:
    """The share of the later requests' prompt tokens that came up from WARM."""
    return rounded(sum(r.tier_hits[WARM] for r in reqs) / sum(len(r.prompt) for r in reqs), 4)


def accuracy_part(model: Any, text_tokens: list[int], codecs: Sequence[str], args: argparse.Namespace) -> dict:
    p, c = args.prefix_tokens, args.continuation_tokens
    chunks = -(-args.positions // (c - 1))
    if len(text_tokens) < chunks * (p + c):
        raise ValueError(f"the text has {len(text_tokens)} tokens; {chunks * (p + c)} needed")
    prefixes = [text_tokens[i * (p + c):i * (p + c) + p] for i in range(chunks)]
    full = [text_tokens[i * (p + c):(i + 1) * (p + c)] for i in range(chunks)]
    lps, shares = {}, {}
    for name in codecs:
        engine = _engine(model, name, chunks * (p + c) + 64, args.block_tokens, args.max_batch_tokens)
        reqs = _through_warm(engine, prefixes, full, 1)
        shares[name] = warm_share(reqs)
        rows = []
        for seq, r in zip(full, reqs):
            logits = torch.cat(r.logits, dim=0)[:c - 1].float()   # positions p .. p+c-2 predict p+1 .. p+c-1
            target = torch.tensor(seq[r.cached_tokens + 1:r.cached_tokens + logits.shape[0] + 1])
            lp = torch.log_softmax(logits, dim=-1)
            rows.append((lp.gather(1, target.view(-1, 1)).view(-1), lp.argmax(dim=-1)))
        lps[name] = rows
        engine.cache.close()
    row: dict[str, Any] = {"part": "accuracy", "text": "this package's module docstrings", "prefix_tokens": p,
                           "positions": sum(x[0].numel() for x in lps[codecs[0]]),
                           **{f"{name}_prompt_share_from_warm": v for name, v in shares.items()}}
    base = lps.get("none")
    for name in codecs:
        if name == "none" or base is None:
            continue
        delta = torch.cat([(a[0] - b[0]).abs() for a, b in zip(lps[name], base)])
        agree = torch.cat([a[1] == b[1] for a, b in zip(lps[name], base)])
        row[f"{name}_max_abs_delta_logprob"] = rounded(delta.max().item(), 6)
        row[f"{name}_mean_abs_delta_logprob"] = rounded(delta.mean().item(), 6)
        row[f"{name}_argmax_agree"] = rounded(agree.float().mean().item(), 5)
    return row


def greedy_part(model: Any, text_tokens: list[int], codecs: Sequence[str], args: argparse.Namespace) -> dict:
    n, k = args.greedy_prompts, args.prompt_tokens
    start = len(text_tokens) - n * k   # the text's end: other text than the accuracy part's
    if start < 0:
        raise ValueError(f"the text has {len(text_tokens)} tokens; {n * k} needed")
    prompts = [text_tokens[start + i * k:start + (i + 1) * k] for i in range(n)]
    outs, shares = {}, {}
    for name in codecs:
        engine = _engine(model, name, n * (k + args.greedy_tokens) + 64, args.block_tokens, args.max_batch_tokens)
        reqs = _through_warm(engine, prompts, prompts, args.greedy_tokens)
        outs[name] = [list(r.output) for r in reqs]
        shares[name] = warm_share(reqs)
        engine.cache.close()
    row: dict[str, Any] = {"part": "greedy", "prompts": n, "prompt_tokens": k, "tokens": args.greedy_tokens,
                           **{f"{name}_prompt_share_from_warm": v for name, v in shares.items()}}
    for name in codecs:
        if name == "none" or "none" not in outs:
            continue
        same = [a == b for a, b in zip(outs[name], outs["none"])]
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                      for a, b in zip(outs[name], outs["none"])]
        row[f"{name}_prompts_agree"] = sum(same)
        row[f"{name}_tokens_before_first_difference"] = sum(first_diff)
    return row


# -------------------------------------------------------------------- workload
class SessionsWorkload:
    """Issue 39's long sessions in ``multiturn.Workload``'s shape: one short system prompt
    every session shares, each session's own document in its first turn, short
    questions, replies of 16..``max_tokens``, Poisson arrivals, exponential think
    times with a share of long pauses (the parameters of ``bench serving --workload sessions``)."""

    def __init__(self, args: argparse.Namespace, vocab: int):
        rng = random.Random(args.seed)
        lo = min(vocab - 1, 256)
        word = lambda: rng.randrange(lo, vocab)   # noqa: E731
        self.system = [[word() for _ in range(args.system_tokens)]]
        self.group = [0] * args.sessions
        self.user = [[[word() for _ in range(args.doc_tokens if t == 0 else 0)] + [word() for _ in range(14)]
                      for t in range(args.turns)] for _ in range(args.sessions)]
        self.reply_len = [[rng.randint(16, args.max_tokens) for _ in range(args.turns)] for _ in range(args.sessions)]
        self.reply_rest = [[[word() for _ in range(max(0, n - args.decode_tokens))] for n in row]
                           for row in self.reply_len]
        at, self.start = 0.0, []
        for s in range(args.sessions):
            at += rng.expovariate(1 / args.arrival_s) if s else 0.0
            self.start.append(at)
        self.think = [[rng.expovariate(1 / (args.long_pause_s if rng.random() < args.long_pause_share
                                            else args.think_s)) for _ in range(args.turns)]
                      for _ in range(args.sessions)]

    def longest_prompt(self) -> int:
        return max(len(self.system[0]) + sum(len(u) for u in self.user[s]) + sum(self.reply_len[s])
                   for s in range(len(self.user)))

    def total_tokens(self) -> int:
        return len(self.system[0]) + sum(sum(len(u) for u in self.user[s]) + sum(self.reply_len[s])
                                         for s in range(len(self.user)))


def workload_part(model: Any, codecs: Sequence[str], args: argparse.Namespace, disk_dir: str) -> list[dict]:
    from lab.bench import multiturn

    work = SessionsWorkload(args, model.config.vocab_size)
    layout = layout_of(model)
    today_mb = TODAY_WARM_BLOCKS * args.block_tokens * layout.bytes_per_token() / (1 << 20)
    prefill = multiturn.measure_prefill(model)
    arms = [("none", today_mb)] + [(name, today_mb / 4) for name in codecs]
    rows = []
    for name, warm_mb in arms:
        ns = argparse.Namespace(
            sessions=args.sessions, turns=args.turns, decode_tokens=args.decode_tokens, block_tokens=args.block_tokens,
            max_batch_tokens=args.max_batch_tokens, device=str(model.device), copy_gb_per_s=args.copy_gb_per_s,
            hot_fraction=args.hot_tokens / work.total_tokens(), header_lead_s=0.0, prefetch_lead_s=0.0,
            tier_codec=name, warm_mb=warm_mb, cold=False)
        res = multiturn.run_policy("tiered+prefetch", model, work, ns, disk_dir, prefill, "arrival")
        rows.append({"part": "workload", "codec": name, "warm_mb": rounded(warm_mb, 1),
                     "warm_share_of_today": rounded(warm_mb / today_mb, 3), "hot_tokens": res["hot_tokens"],
                     "sessions": args.sessions, "turns": args.turns, "session_tokens": res["session_tokens"],
                     **{k: res[k] for k in ("requests", "failed_requests", "later_turn_cached_share",
                                            "later_ttft_ms_p50", "later_ttft_ms_p99", "hit_rate", "ttft_ms_p50",
                                            "ttft_ms_p99", "promoted_tokens", "demoted_to_warm",
                                            "recomputed_held_tokens", "sim_seconds", "wall_seconds")}})
    return rows
