"""``bench serving --memory-mb M --working-set R``: this app against vLLM given the same bytes of KV.

Both servers get ``M`` MiB for KV: this app as one budget per replica
(``kv_memory_mb``, split by the server; COLD on disk by default, as a
deployment gets it), vLLM (``vllm-same-memory``) as its KV cache, in its
default mode. The workload is sized to ``R`` times what ``M`` holds, so one
run shows the same client inside memory (R <= 1) and beyond it (R >= 2):

- ``sessions``: sessions of their own document (``session_workload``); the
  number of sessions is what makes R;
- ``shared-prefix``: single requests, each a distinct question after one of
  several shared documents of ``--prefix-tokens`` tokens, Poisson arrivals
  (mean gap ``--arrival-s``), ``--max-tokens`` 32 each; the number of
  distinct prefixes is what makes R.

Every row carries TPOT p50/p99, ITL p99 and the longest gap (a stalled
stream), e2e p50, output tokens/s and preemptions per stream beside the TTFTs.
The ``equal_memory`` summary row gives each ratio to ``vllm-same-memory`` and
the goals of issue 51 for that R.
"""

from __future__ import annotations

import random

from lab.bench.common import rounded
from lab.load.session_workload import PlannedSession, PlannedTurn, _exp, distinct_questions, document

# What one turn adds to a session beyond its document, in tokens: a question (~15) and a reply
# (the workload's replies average about half of --max-tokens), with the chat template's framing.
QUESTION_TOKENS = 20


def kv_token_bytes(model_dir) -> int:
    """Bytes of one token's KV of the checkpoint at ``model_dir`` in float32 (both servers' dtype here)."""
    from cluster.engine.checkpoint import _read_json, model_config_from_hf

    cfg = model_config_from_hf(_read_json(model_dir / "config.json"))
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4


def memory_tokens(memory_mb: float, token_bytes: int) -> int:
    return int(memory_mb * (1 << 20)) // token_bytes


def session_tokens(args) -> int:
    """About how many tokens one session of the sessions workload holds at its end."""
    return args.system_tokens + args.doc_tokens + args.turns * (QUESTION_TOKENS + args.max_tokens // 2)


def sized_workload(args, working_set: float, tokens_in_memory: int) -> dict:
    """The workload flags that make its working set ``working_set`` times ``tokens_in_memory``:
    ``sessions`` (sessions workload) or ``prefixes`` (shared-prefix workload)."""
    if args.workload == "sessions":
        return {"sessions": max(1, round(working_set * tokens_in_memory / session_tokens(args)))}
    per_prefix = args.system_tokens + args.prefix_tokens + QUESTION_TOKENS
    return {"prefixes": max(1, round(working_set * tokens_in_memory / per_prefix))}


def plan_shared_prefixes(tokenizer, *, prefixes: int, prefix_tokens: int, requests: int, arrival_s: float,
                         max_tokens: int, seed: int) -> list[PlannedSession]:
    """``requests`` single-turn requests (each a session of one turn, with no session header),
    arriving as a Poisson process, each a distinct question after one of ``prefixes`` shared
    documents (drawn uniformly, every prefix at least once while requests allow)."""
    if prefixes < 1 or requests < 1 or max_tokens < 1 or prefix_tokens < 1:
        raise ValueError("prefixes, requests, max_tokens and prefix_tokens must be >= 1")
    arrivals, picks = random.Random(f"{seed}:arrivals"), random.Random(f"{seed}:prefix")
    order = list(range(prefixes))
    picks.shuffle(order)
    chosen = [order[i] if i < prefixes else picks.randrange(prefixes) for i in range(requests)]
    docs = {k: document(tokenizer, prefix_tokens, seed, k) for k in sorted(set(chosen))}
    questions = distinct_questions(requests, random.Random(f"{seed}:questions"))
    out, start = [], 0.0
    for i in range(requests):
        if i:
            start += _exp(arrivals, arrival_s)
        out.append(PlannedSession(i, f"request-{seed}-{i:04d}", start, docs[chosen[i]],
                                  (PlannedTurn(0, questions[i], max_tokens, 0.0, False),)))
    return out


def preemptions_per_stream(row: dict) -> float | None:
    requests = row.get("requests")
    return rounded(row.get("preemptions", 0) / requests, 3) if requests else None


def compare_equal_memory(ours: dict, peer: dict | None, working_set: float) -> dict:
    """Our row against ``vllm-same-memory``'s at working set ``working_set``: each ratio (ours
    over theirs) and issue 51's goals (None where the peer did not run or a figure is missing)."""
    out: dict = {"workload": ours.get("workload"), "working_set": working_set,
                 "preemptions_per_stream": preemptions_per_stream(ours),
                 "peer_preemptions_per_stream": preemptions_per_stream(peer) if peer else None}
    keys = ("tpot_ms_p50", "tpot_ms_p99", "itl_ms_p99", "itl_ms_max", "e2e_ms_p50", "output_tokens_per_s",
            "ttft_ms_p50", "ttft_ms_later_turns_p50")
    for key in keys:
        a, b = ours.get(key), (peer or {}).get(key)
        out[f"{key}_vs_same_memory"] = rounded(a / b, 3) if a is not None and b else None

    def at_most(key: str, bound: float) -> bool | None:
        value = out[f"{key}_vs_same_memory"]
        return None if value is None else value <= bound

    out["goal_no_failures"] = ours.get("failed") == 0
    for key in ("tpot_ms_p50", "itl_ms_p99", "e2e_ms_p50"):
        out[f"goal_{key}_le_1x"] = at_most(key, 1.0)
    tput = out["output_tokens_per_s_vs_same_memory"]
    out["goal_throughput_ge_1x"] = None if tput is None else tput >= 1.0
    if ours.get("workload") == "sessions":
        later = "ttft_ms_later_turns_p50"
        if working_set <= 1:
            out["goal_later_ttft_p50_le_1x"] = at_most(later, 1.0)
        if working_set >= 2:
            out["goal_later_ttft_p50_le_0_1x"] = at_most(later, 0.1)
            share = ours.get("later_turns_cached_share")
            out["goal_later_cached_ge_0_9"] = None if share is None else share >= 0.9
            out["goal_throughput_ge_2x"] = None if tput is None else tput >= 2.0
    held = ours.get("recomputed_held_tokens")
    out["goal_no_recomputed_held"] = None if held is None else held == 0
    return out
