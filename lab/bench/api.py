"""``prefix-cache bench api``: what the API's client-facing features cost, and two real clients.

    prefix-cache bench api [--model SPEC] [--prompt-tokens 512] [--repeats 5] [--parts all]

One replica of the real model on the embedded local cluster (real Serve, the
real ingress), then one JSON row per part, each comparing against its own
baseline in the same run:

- ``n_fork``: one request with ``n: 8`` against eight requests of eight different
  prompts of the same length (eight prefills), same ``max_tokens``, all at
  once. ``prefill_tokens`` is what the replica computed of the prompts (the
  engine's prompt tokens less its cached tokens); ``wall_s`` each;
  ``prefill_ratio`` = n=8's prefill over the eight prefills'.
- ``structured``: the time per generated token (streamed, first token excluded)
  of a greedy answer unconstrained, under a regex and under a JSON schema, each
  alone and beside an unconstrained request (two running at once, so the mask's
  cost to the other request of the batch shows); medians over ``--repeats``;
  ``overhead_pct`` of each constrained kind over unconstrained.
- ``echo``: a ``--prompt-tokens`` prompt scored with ``echo`` and ``logprobs: 5``
  (what an evaluation harness sends) against the same request without them,
  each on a cold prompt and again with the prompt cached (the cached part's
  logprobs are kept beside its KV, so they are not recomputed).
- ``lm_eval``: lm-eval's ``local-completions`` against the server and lm-eval's
  own ``hf`` model on the same checkpoint, on a small local multiple-choice task:
  both accuracies, the largest per-choice loglikelihood difference, and the
  share of the server's prompt tokens that came from the cache.
- ``tool_loop``: the official ``openai`` client's two-step tool loop (a forced
  call, then the tool's answer): the second step's cached tokens against the
  first step's prompt and reply.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from lab.bench.common import emit

PARTS = ("n_fork", "structured", "echo", "lm_eval", "tool_loop")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                           "population": {"type": "integer"},
                                           "landmarks": {"type": "array", "items": {"type": "string",
                                                                                    "maxLength": 40}}},
          "required": ["city", "population", "landmarks"], "additionalProperties": False}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt length of n_fork and echo")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per choice (n_fork, structured)")
    p.add_argument("--repeats", type=int, default=5, help="repeats per measurement (medians)")
    p.add_argument("--parts", default="all", help=f"comma-separated: {', '.join(PARTS)} (default all)")
    p.add_argument("--torch-threads", type=int, default=2, help="the replica's torch threads")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)


class Api:
    """A running server, as the parts use it (``engine`` needs its admin endpoints)."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model

    def post(self, path: str, body: dict) -> dict:
        import httpx

        r = httpx.post(self.url + path, json={"model": self.model, **body}, timeout=600)
        if r.status_code != 200:
            raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def engine(self) -> dict:
        """Prompt and cached tokens the replicas' engines have seen so far."""
        import httpx

        workers = httpx.get(self.url + "/v1/cache/stats", timeout=60).json()["workers"].values()
        return {k: sum(w["engine"][k] for w in workers) for k in ("prompt_tokens", "cached_tokens")}

    def streamed_ms_per_token(self, body: dict) -> tuple[float, int]:
        """Mean time between streamed tokens after the first, and the token count."""
        import httpx

        stamps = []
        with httpx.stream("POST", self.url + "/v1/chat/completions", timeout=600,
                          json={"model": self.model, "stream": True, **body}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and '"content": "' in line:
                    stamps.append(time.perf_counter())
        if len(stamps) < 3:
            raise RuntimeError(f"the stream gave {len(stamps)} content chunks; expected many")
        return (stamps[-1] - stamps[0]) * 1000 / (len(stamps) - 1), len(stamps)



class Server(Api):
    """The local cluster with one replica, admin open (the bench reads engine stats)."""

    def __init__(self, args, model: str):
        from serve_app.local import LocalCluster, free_port

        self.local = LocalCluster(worker_nodes=1, l3_pool_mb=0)
        port = args.port or free_port()
        self.local.deploy({"num_replicas": 1, "admin_without_keys": True, "namespace": "prefix-cache-bench-api",
                           "limits": {"max_prompt_tokens": 4096, "max_tokens": 512},
                           "worker": {"model": args.model, "block_tokens": 16, "hot_blocks": 1024,
                                      "warm_blocks": 1024, "torch_threads": args.torch_threads}}, port=port)
        super().__init__(f"http://127.0.0.1:{port}", model)

    def close(self) -> None:
        self.local.shutdown()


def _prefilled(server: Api, run) -> tuple[int, float]:
    before = server.engine()
    t0 = time.perf_counter()
    run()
    wall = time.perf_counter() - t0
    after = server.engine()
    return (after["prompt_tokens"] - after["cached_tokens"]) - (before["prompt_tokens"] - before["cached_tokens"]), wall


def n_fork(server: Api, prompts: list[str], args) -> dict:
    body = {"max_tokens": args.max_tokens, "temperature": 1.0, "ignore_eos": True}
    forked = [None]

    def one_request():
        forked[0] = server.post("/v1/completions", {"prompt": prompts[0], "n": 8, "seed": 1, **body})

    def eight_prefills():
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda p: server.post("/v1/completions", {"prompt": p, "seed": 1, **body}), prompts[1:9]))

    n8_tokens, n8_wall = _prefilled(server, one_request)
    eight_tokens, eight_wall = _prefilled(server, eight_prefills)
    return {"part": "n_fork", "n": 8, "prompt_tokens": forked[0]["usage"]["prompt_tokens"],
            "max_tokens": args.max_tokens, "prefill_tokens": n8_tokens, "eight_prefills_tokens": eight_tokens,
            "prefill_ratio": n8_tokens / eight_tokens, "wall_s": n8_wall, "eight_prefills_wall_s": eight_wall,
            "wall_ratio": n8_wall / eight_wall,
            "distinct_choices": len({tuple(c["token_ids"]) for c in forked[0]["choices"]})}


def structured(server: Api, args) -> dict:
    ask = [{"role": "user", "content": "Describe Paris as a JSON object with its name, population and landmarks."}]
    kinds = {"unconstrained": {"ignore_eos": True},
             "regex": {"structured_outputs": {"regex": "[A-Za-z ,.]{400}"}},
             "json_schema": {"response_format": {"type": "json_schema",
                                                 "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}}}
    body = {"messages": ask, "max_tokens": args.max_tokens, "temperature": 0}
    alone: dict[str, list[float]] = {k: [] for k in kinds}
    beside: dict[str, list[float]] = {k: [] for k in kinds}
    tokens: dict[str, int] = {}
    server.streamed_ms_per_token({**body, **kinds["unconstrained"]})   # warm: the prompt is cached for all
    for _ in range(args.repeats):
        for kind, extra in kinds.items():
            ms, tokens[kind] = server.streamed_ms_per_token({**body, **extra})
            alone[kind].append(ms)
            with ThreadPoolExecutor(2) as pool:   # this kind beside an unconstrained one: the other's time
                mine = pool.submit(server.streamed_ms_per_token, {**body, **extra})
                other = pool.submit(server.streamed_ms_per_token, {**body, **kinds["unconstrained"]})
                mine.result()
                beside[kind].append(other.result()[0])
    med = {k: statistics.median(v) for k, v in alone.items()}
    med_beside = {k: statistics.median(v) for k, v in beside.items()}
    row = {"part": "structured", "repeats": args.repeats}
    for kind in kinds:
        row[f"ms_per_token_{kind}"] = med[kind]
        row[f"tokens_{kind}"] = tokens[kind]
        row[f"other_ms_per_token_beside_{kind}"] = med_beside[kind]
    for kind in ("regex", "json_schema"):
        row[f"overhead_pct_{kind}"] = 100 * (med[kind] / med["unconstrained"] - 1)
        row[f"other_overhead_pct_beside_{kind}"] = 100 * (med_beside[kind] / med_beside["unconstrained"] - 1)
    return row


def echo(server: Api, prompts: list[str], args) -> dict:
    def timed(body: dict) -> float:
        t0 = time.perf_counter()
        server.post("/v1/completions", {"max_tokens": 1, "temperature": 0, **body})
        return 1000 * (time.perf_counter() - t0)

    cold_plain, cold_echo, warm_plain, warm_echo = [], [], [], []
    for i in range(args.repeats):   # fresh prompts each repeat: the cold arms are cold
        plain_prompt, echo_prompt = prompts[9 + 2 * i], prompts[10 + 2 * i]
        cold_plain.append(timed({"prompt": plain_prompt}))
        cold_echo.append(timed({"prompt": echo_prompt, "echo": True, "logprobs": 5}))
        warm_plain.append(timed({"prompt": plain_prompt}))
        warm_echo.append(timed({"prompt": echo_prompt, "echo": True, "logprobs": 5}))
    med = statistics.median
    return {"part": "echo", "prompt_tokens": args.prompt_tokens, "repeats": args.repeats,
            "cold_ms": med(cold_plain), "cold_echo_ms": med(cold_echo),
            "cold_echo_overhead_pct": 100 * (med(cold_echo) / med(cold_plain) - 1),
            "cached_ms": med(warm_plain), "cached_echo_ms": med(warm_echo),
            "cached_echo_overhead_pct": 100 * (med(warm_echo) / med(warm_plain) - 1)}


def lm_eval(server: Api, args) -> dict:
    from cluster.engine.checkpoint import ModelSpec, resolve_checkpoint
    from lab.load.api_clients import lm_eval_compare

    before = server.engine()
    t0 = time.perf_counter()
    result = lm_eval_compare(server.url, server.model, resolve_checkpoint(ModelSpec.parse(args.model)))
    wall = time.perf_counter() - t0
    after = server.engine()
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    return {"part": "lm_eval", "task": "prefix_cache_mc (8 questions x 4 choices, local files)",
            "acc_server": result["acc_server"], "acc_hf": result["acc_hf"], "choices": result["choices"],
            "max_abs_loglikelihood_diff": result["max_abs_diff"], "within_1e-4": result["max_abs_diff"] <= 1e-4,
            "server_prompt_tokens": prompt, "cached_token_share": cached / prompt if prompt else None,
            "wall_s": wall}


def tool_loop(server: Api, args) -> dict:
    from lab.load.api_clients import openai_tool_loop

    r = openai_tool_loop(server.url, server.model)
    # The reply's last token (the stop token) was sampled but never run through the
    # model: no KV of it exists to reuse.
    first = r["prompt_tokens_1"] + r["completion_tokens_1"] - 1
    return {"part": "tool_loop", **r, "first_step_kv_tokens": first,
            "covers_first_step": r["cached_tokens_2"] >= first}


def run(args: argparse.Namespace) -> int:
    from cluster.engine.checkpoint import ModelSpec, load_tokenizer
    from lab.load.chat_workload import system_prompt
    from serve_app.local import prepare_model

    parts = list(PARTS) if args.parts == "all" else args.parts.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"--parts: unknown {unknown}; choose from {', '.join(PARTS)} or all")
    for name in ("prompt_tokens", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    model = prepare_model(args.model)
    tokenizer = load_tokenizer(ModelSpec.parse(args.model))
    prompts = [system_prompt(tokenizer, args.prompt_tokens, args.seed * 1000 + i)
               for i in range(9 + 2 * args.repeats)]
    server = Server(args, model)
    try:
        for part in parts:
            if part == "n_fork":
                row = n_fork(server, prompts, args)
            elif part == "structured":
                row = structured(server, args)
            elif part == "echo":
                row = echo(server, prompts, args)
            elif part == "lm_eval":
                row = lm_eval(server, args)
            else:
                row = tool_loop(server, args)
            emit({"bench": "api", "model": model,
                  **{k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in row.items()}})
    finally:
        server.close()
    return 0
