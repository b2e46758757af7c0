"""``prefix-cache bench http``: request-path latency over HTTP against a bare Ray Serve app, in one run.

Starts the embedded local cluster (a head and two worker nodes on
127.0.0.1), deploys the prefix-cache app (three cache replicas of
``--model``) and, beside it on the same cluster and HTTP proxy, the bare
two-hop Ray Serve echo app of the same shape (``lab.load.echo_app``). After
a warm-up, sequential requests, taken in turns (one echo, one prefix-cache)
so the shared machine's noise falls on both arms alike:

- ``impl: ray-serve-echo``: ``latency_ms_p50/p99`` of a POST whose body is
  echoed through the second deployment;
- ``impl: prefix-cache``: ``latency_ms_p50/p99`` of a 1-token completion
  (non-streamed, a short prompt), ``path_ms_p50``: the same less each
  request's first forward (what the path costs beyond the model), and
  ``ttft_ms_cached_p50/p99``: the first
  streamed chunk of a ``--prompt-tokens`` prompt whose first
  ``prompt_tokens - suffix_tokens`` tokens are cached (a different suffix
  each time). ``suffix_forward_ms_p50`` is the model's own time to compute
  that suffix (the replica's first forward, from the requests' timings) and
  ``ttft_goal_ms`` = 1-token p50 + 2 x that. ``breakdown_ms_p50`` and
  ``ttft_breakdown_ms_p50`` say where the time went (``serve_app.timing``:
  parse and tokenize, routing decision, hop to the replica, replica queue,
  prefix load, first forward, stream back, respond), the median of each part
  over the requests' own timestamps. ``route_ms_p50/p99``: the routing
  step as the requests saw it (the router's, on its copy of the
  directory's table: ``routed_locally`` is the share decided there; block
  hashing and the router's event loop included, wall clock);
  ``decision_us_p50/p99``: the decision itself (the policy's ``choose`` on
  that table, in the router thread's CPU time, so the turns other processes
  take on a shared machine do not count), the goal's figure;
  ``directory_decision_us_p50/p99``: the directory's own decisions, for the
  requests that asked it (``directory_decisions``).

Then a throughput phase (``--concurrency`` clients for ``--throughput-s``
seconds of 1-token completions, each a prompt never seen before): one
``impl: prefix-cache-throughput`` row with ``requests_per_s`` and
``decisions_per_s`` (every request decided by the ingress replica that took
it: counted from the answers), ``ingress_replicas_seen`` (how many distinct
ingress replicas answered: the deployment runs ``--ingress-replicas`` of
them, each deciding on its own copy of the routing table) and the share
decided there (``routed_locally``).

One JSON line per implementation, then one ``summary`` line with the
ratios and whether each goal of the issue is met.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from lab.bench.common import emit, percentile, rounded

PARTS = ("read_body", "parse_tokenize", "route", "to_replica", "migrate", "replica_queue", "prefix_load", "first_forward",
         "stream_back",
         "ingress_other", "respond", "ttft", "total")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=100, help="measured requests per arm")
    p.add_argument("--warmup", type=int, default=10, help="unmeasured requests per arm first")
    p.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct; "
                                                  "'builtin' for the seeded test model)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--ingress-replicas", type=int, default=1,
                   help="HTTP ingress replicas (each decides on its own copy of the routing table)")
    p.add_argument("--concurrency", type=int, default=16, help="clients of the throughput phase")
    p.add_argument("--throughput-s", type=float, default=10.0, help="length of the throughput phase (0: skip it)")
    p.add_argument("--prompt-tokens", type=int, default=2000, help="tokens of the cached-prefix TTFT prompt")
    p.add_argument("--suffix-tokens", type=int, default=16, help="of those, new (uncached) tokens per request")
    p.add_argument("--port", type=int, default=0, help="HTTP port (default: a free one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", default=None, metavar="JSON",
                   help='worker config keys over the demo\'s, e.g. \'{"cache_final_token": true}\'')


def _ms(seconds: list[float]) -> tuple[float, float]:
    return rounded(percentile(seconds, 50) * 1e3, 3), rounded(percentile(seconds, 99) * 1e3, 3)


def _median_parts(timings: list[dict]) -> dict:
    out = {}
    for part in PARTS:
        values = [t[part] for t in timings if part in t]
        if values:
            out[part] = rounded(statistics.median(values), 3)
    return out


class Arms:
    """The two apps behind one HTTP proxy, with one keep-alive client."""

    def __init__(self, base: str, model: str, prompt_ids: list[int], suffix_tokens: int, vocab: int, seed: int):
        import httpx

        self.http = httpx.Client(base_url=base, timeout=120)
        self.model = model
        self.prefix = prompt_ids[:len(prompt_ids) - suffix_tokens]
        self.suffix_tokens = suffix_tokens
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.one_token = {"model": model, "prompt": "Hello", "max_tokens": 1}

    def echo(self) -> float:
        t0 = time.perf_counter()
        r = self.http.post("/echo/v1/completions", json=self.one_token)
        r.raise_for_status()
        return time.perf_counter() - t0

    def one(self) -> tuple[float, dict, str | None, bool]:
        """One 1-token completion: (seconds, timing, routed by, whether its prefix was pulled)."""
        t0 = time.perf_counter()
        r = self.http.post("/v1/completions", json=self.one_token)
        r.raise_for_status()
        elapsed = time.perf_counter() - t0
        info = r.json()["prefix_cache"]
        return elapsed, info.get("timing_ms", {}), info.get("routed_by"), info.get("migration") is not None

    def throughput(self, concurrency: int, seconds: float) -> dict:
        """``concurrency`` clients sending 1-token completions of fresh prompts for
        ``seconds``: what was answered, by which ingress replicas, decided where."""
        import asyncio

        import httpx

        base, model, vocab = str(self.http.base_url), self.model, self.vocab

        async def client(i: int, deadline: float, out: list) -> None:
            rng = random.Random(i)
            async with httpx.AsyncClient(base_url=base, timeout=120) as http:
                while time.perf_counter() < deadline:
                    prompt = [rng.randrange(100, vocab) for _ in range(8)]
                    r = await http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1})
                    r.raise_for_status()
                    info = r.json()["prefix_cache"]
                    out.append((info.get("ingress_id"), info.get("routed_by"),
                                info.get("timing_ms", {}).get("route_decision")))

        async def run() -> tuple[list, float]:
            out: list = []
            t0 = time.perf_counter()
            deadline = t0 + seconds
            await asyncio.gather(*[client(i, deadline, out) for i in range(concurrency)])
            return out, time.perf_counter() - t0

        answers, elapsed = asyncio.run(run())
        return {"answers": answers, "elapsed_s": elapsed}

    def warm_prefix(self) -> None:
        r = self.http.post("/v1/completions", json={"model": self.model, "prompt": self.prefix, "max_tokens": 1})
        r.raise_for_status()

    def cached_ttft(self) -> tuple[float, dict, int, str | None, bool]:
        """One streamed request: the cached prefix and a new suffix; (TTFT, timing, cached tokens, routed by,
        whether its prefix was pulled from another replica)."""
        suffix = [self.rng.randrange(100, self.vocab) for _ in range(self.suffix_tokens)]
        body = {"model": self.model, "prompt": self.prefix + suffix, "max_tokens": 2, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        ttft, last = None, {}
        with self.http.stream("POST", "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - t0
                last = json.loads(line[6:])
        if "error" in last:
            raise RuntimeError(f"streamed request failed: {last['error']}")
        cached = last.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens", 0)
        info = last.get("prefix_cache", {})
        return ttft, info.get("timing_ms", {}), cached, info.get("routed_by"), info.get("migration") is not None

    def close(self) -> None:
        self.http.close()


def _prompt_ids(model_spec, n: int, seed: int) -> tuple[list[int], int]:
    from cluster.engine.checkpoint import ModelSpec, load_tokenizer

    tok = load_tokenizer(ModelSpec.parse(model_spec))
    rng = random.Random(seed)
    return [rng.randrange(100, tok.vocab_size) for _ in range(n)], tok.vocab_size


def measure(arms: Arms, requests: int, warmup: int) -> dict:
    for _ in range(warmup):
        arms.echo()
        arms.one()
    echo, one, timings, routed_by, pulled = [], [], [], [], []
    for _ in range(requests):   # in turns: the machine's noise falls on both arms
        echo.append(arms.echo())
        elapsed, timing, source, migrated = arms.one()
        one.append(elapsed)
        pulled.append(migrated)
        timings.append(timing)
        routed_by.append(source)
    arms.warm_prefix()
    time.sleep(0.5)   # the holder's KV events reach the directory
    for _ in range(min(warmup, 3)):
        arms.cached_ttft()
    ttfts, ttft_timings, cached = [], [], []
    for _ in range(requests):
        ttft, timing, n, source, migrated = arms.cached_ttft()
        pulled.append(migrated)
        ttfts.append(ttft)
        ttft_timings.append(timing)
        cached.append(n)
        routed_by.append(source)
    return {"echo": echo, "one": one, "timings": timings, "ttfts": ttfts, "ttft_timings": ttft_timings,
            "cached": cached, "routed_by": routed_by, "pulled": pulled}


def throughput_row(t: dict, args) -> dict:
    answers, elapsed = t["answers"], t["elapsed_s"]
    decisions = [d * 1e3 for _, _, d in answers if d is not None]
    return {"bench": "http", "impl": "prefix-cache-throughput", "concurrency": args.concurrency,
            "seconds": rounded(elapsed, 2), "requests": len(answers),
            "requests_per_s": rounded(len(answers) / elapsed, 2) if elapsed else None,
            "decisions_per_s": rounded(sum(1 for _, r, _ in answers if r is not None) / elapsed, 2) if elapsed else None,
            "routed_locally": rounded(sum(1 for _, r, _ in answers if r == "router_view") / len(answers), 4)
            if answers else 0.0,
            "decision_us_p50": rounded(percentile(decisions, 50), 1) if decisions else None,
            "decision_us_p99": rounded(percentile(decisions, 99), 1) if decisions else None,
            "ingress_replicas": args.ingress_replicas,
            "ingress_replicas_seen": len({i for i, _, _ in answers if i is not None}), "replicas": args.replicas}


def rows(m: dict, args, directory_stats: dict) -> list[dict]:
    echo_p50, echo_p99 = _ms(m["echo"])
    one_p50, one_p99 = _ms(m["one"])
    # What the request path costs beyond the model: each request's latency less its first forward.
    path = [e - t.get("first_forward", 0.0) / 1e3 for e, t in zip(m["one"], m["timings"])]
    path_p50, _ = _ms(path)
    ttft_p50, ttft_p99 = _ms(m["ttfts"])
    ttft_parts = _median_parts(m["ttft_timings"])
    suffix_ms = ttft_parts.get("first_forward", 0.0)
    goal_ttft = rounded(one_p50 + 2 * suffix_ms, 3)
    # The decision as the requests saw it (the router's, on its table copy or from the directory).
    routes = [t["route"] for t in m["timings"] + m["ttft_timings"] if "route" in t]
    route_p50, route_p99 = (rounded(percentile(routes, 50), 3), rounded(percentile(routes, 99), 3)) if routes \
        else (None, None)
    local = sum(1 for r in m["routed_by"] if r == "router_view")
    decisions = [t["route_decision"] * 1e3 for t in m["timings"] + m["ttft_timings"] if "route_decision" in t]
    dec_p50, dec_p99 = (rounded(percentile(decisions, 50), 1), rounded(percentile(decisions, 99), 1)) \
        if decisions else (None, None)
    echo_row = {"bench": "http", "impl": "ray-serve-echo", "requests": len(m["echo"]),
                "latency_ms_p50": echo_p50, "latency_ms_p99": echo_p99, "replicas": args.replicas}
    ingress = getattr(args, "ingress_replicas", 1)
    ours = {"bench": "http", "impl": "prefix-cache", "requests": len(m["one"]), "model": args.model_id,
            "latency_ms_p50": one_p50, "latency_ms_p99": one_p99, "path_ms_p50": path_p50,
            "ttft_ms_cached_p50": ttft_p50, "ttft_ms_cached_p99": ttft_p99,
            "prompt_tokens": args.prompt_tokens, "suffix_tokens": args.suffix_tokens,
            "cached_tokens_p50": int(statistics.median(m["cached"])) if m["cached"] else 0,
            "suffix_forward_ms_p50": suffix_ms, "ttft_goal_ms": goal_ttft,
            "breakdown_ms_p50": _median_parts(m["timings"]), "ttft_breakdown_ms_p50": ttft_parts,
            "route_ms_p50": route_p50, "route_ms_p99": route_p99,
            "decision_us_p50": dec_p50, "decision_us_p99": dec_p99,
            "routed_locally": rounded(local / len(m["routed_by"]), 4) if m["routed_by"] else 0.0,
            "directory_decisions": directory_stats.get("decisions"),
            "directory_decision_us_p50": directory_stats.get("decision_us_p50"),
            "directory_decision_us_p99": directory_stats.get("decision_us_p99"), "replicas": args.replicas,
            "ingress_replicas": ingress}
    ratio = rounded(one_p50 / echo_p50, 3) if echo_p50 else None
    summary = {"bench": "http", "impl": "summary", "latency_p50_ratio_vs_echo": ratio,
               "path_p50_ratio_vs_echo": rounded(path_p50 / echo_p50, 3) if echo_p50 else None,
               "goal_latency_p50_le_1_5x_echo": ratio is not None and ratio <= 1.5,
               "goal_cached_ttft_p50_le_1tok_plus_2x_suffix": ttft_p50 <= goal_ttft,
               "goal_routing_decision_p99_lt_1ms": dec_p99 is not None and dec_p99 < 1000}
    return [echo_row, ours, summary]


def run(args: argparse.Namespace) -> int:
    from ray import serve

    from lab.load.echo_app import APP_NAME as ECHO_APP
    from lab.load.echo_app import ROUTE_PREFIX, build_echo_app
    from serve_app.local import DEMO_WORKER, LocalCluster, free_port, prepare_model

    if args.suffix_tokens < 1 or args.prompt_tokens <= args.suffix_tokens:
        raise ValueError("need 1 <= --suffix-tokens < --prompt-tokens")
    if args.ingress_replicas < 1 or args.concurrency < 1 or args.throughput_s < 0:
        raise ValueError("need --ingress-replicas >= 1, --concurrency >= 1 and --throughput-s >= 0")
    args.model_id = prepare_model(args.model)
    prompt_ids, vocab = _prompt_ids(args.model, args.prompt_tokens, args.seed)
    local = LocalCluster(worker_nodes=2)
    port = args.port or free_port()   # once the cluster's processes hold their ports
    try:
        worker = dict(DEMO_WORKER)
        if args.model is not None:
            worker["model"] = args.model
        if args.worker:
            worker.update(json.loads(args.worker))
        local.deploy({"num_replicas": args.replicas, "ingress_replicas": args.ingress_replicas, "worker": worker},
                     port=port)
        serve.run(build_echo_app(args.replicas), name=ECHO_APP, route_prefix=ROUTE_PREFIX, blocking=False)
        _wait_echo(f"http://127.0.0.1:{port}")
        arms = Arms(f"http://127.0.0.1:{port}", args.model_id, prompt_ids, args.suffix_tokens, vocab, args.seed)
        try:
            m = measure(arms, args.requests, args.warmup)
            t = arms.throughput(args.concurrency, args.throughput_s) if args.throughput_s else None
        finally:
            arms.close()
        echo_row, ours, summary = rows(m, args, _directory_stats())
        for row in (echo_row, ours) + ((throughput_row(t, args),) if t is not None else ()) + (summary,):
            emit(row)
    finally:
        try:
            serve.delete(ECHO_APP)
        finally:
            local.shutdown()
    return 0


def _wait_echo(base: str, timeout_s: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.post(base + "/echo/v1/completions", json={}, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the echo app did not answer within {timeout_s}s")


def _directory_stats() -> dict:
    import ray

    from cluster.names import DEFAULT_NAMESPACE, DIRECTORY_NAME

    directory = ray.get_actor(DIRECTORY_NAME, namespace=DEFAULT_NAMESPACE)
    return ray.get(directory.get_stats.remote(), timeout=30)
