"""``prefix-cache demo``: the whole system on this machine, measured.

Starts a local Ray cluster of a head and two worker nodes on 127.0.0.1,
deploys the app with the built-in model (one cache replica per node), drives
a multi-turn chat workload through HTTP (streaming, so TTFT is the first
chunk), once with the ``cost`` router and once with ``round_robin`` (caches
flushed in between), prints hit rate and TTFT p50/p99 side by side, writes a
PNG of the TTFT distributions, and shuts everything down.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

from cluster.bench.common import percentile, plot_cdfs
from serve_app.local import DEMO_WORKER, LocalCluster, free_port


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--system-chars", type=int, default=1200, help="shared system prompt length (bytes)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--policies", default="cost,round_robin")
    p.add_argument("--plot", default="prefix-cache-demo.png")
    p.add_argument("--port", type=int, default=0, help="HTTP port (default: a free one)")
    p.add_argument("--seed", type=int, default=0)


def make_sessions(args) -> list[dict]:
    rng = random.Random(args.seed)
    words = "cache prefix radix tier block token replica route latency throughput memory host disk".split()
    systems = [" ".join(rng.choice(words) for _ in range(args.system_chars // 6))[:args.system_chars]
               for _ in range(3)]
    return [{"id": f"s{i}", "system": systems[i % len(systems)],
             "questions": [" ".join(rng.choice(words) for _ in range(rng.randint(8, 30))) + "?"
                           for _ in range(args.turns)]} for i in range(args.sessions)]


async def run_policy(base: str, policy: str, sessions: list[dict], args, progress) -> list[dict]:
    import httpx

    results: list[dict] = []
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        r = await client.post("/v1/admin/policy", json={"policy": policy})
        r.raise_for_status()
        (await client.post("/v1/cache/flush")).raise_for_status()
        sem = asyncio.Semaphore(args.concurrency)

        async def chat(sess: dict) -> None:
            messages = [{"role": "system", "content": sess["system"]}]
            for q in sess["questions"]:
                messages.append({"role": "user", "content": q})
                async with sem:
                    t0 = time.perf_counter()
                    ttft, text, usage = None, [], {}
                    async with client.stream("POST", "/v1/chat/completions", json={
                            "model": "prefix-cache-byte", "messages": messages, "max_tokens": args.max_tokens,
                            "stream": True, "session_id": sess["id"]}) as resp:
                        resp.raise_for_status()
                        async for line in resp.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            chunk = json.loads(line[6:])
                            if ttft is None:
                                ttft = time.perf_counter() - t0
                            for ch in chunk.get("choices", []):
                                text.append(ch.get("delta", {}).get("content", ""))
                            usage = chunk.get("usage") or usage
                results.append({"ttft_ms": ttft * 1e3, "prompt_tokens": usage.get("prompt_tokens", 0),
                                "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)})
                messages.append({"role": "assistant", "content": "".join(text)})
                progress.update(1)
                await asyncio.sleep(0)

        await asyncio.gather(*(chat(s) for s in sessions))
    return results


def summarize(policy: str, results: list[dict]) -> dict:
    ttfts = [r["ttft_ms"] for r in results]
    prompt = sum(r["prompt_tokens"] for r in results)
    return {"policy": policy, "requests": len(results),
            "hit_rate": sum(r["cached_tokens"] for r in results) / prompt if prompt else 0.0,
            "ttft_ms_p50": percentile(ttfts, 50), "ttft_ms_p99": percentile(ttfts, 99), "_ttfts": ttfts}


def plot(rows: list[dict], path: str) -> None:
    plot_cdfs([(f"{r['policy']} (hit {r['hit_rate']:.0%}, p50 {r['ttft_ms_p50']:.0f} ms)", r["_ttfts"]) for r in rows],
              path, title="prefix-cache demo: cost router vs round robin",
              xlabel="time to first token over HTTP (ms, log scale)")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    policies = args.policies.split(",")
    port = args.port or free_port()
    print("starting a local Ray cluster (head + 2 worker nodes on 127.0.0.1)...", flush=True)
    local = LocalCluster(worker_nodes=2)
    try:
        print(f"deploying the app (3 cache replicas, built-in model) on http://127.0.0.1:{port} ...", flush=True)
        local.deploy({"num_replicas": 3, "worker": dict(DEMO_WORKER)}, port=port)
        sessions = make_sessions(args)
        rows = []
        for policy in policies:
            with tqdm(total=args.sessions * args.turns, desc=f"{policy:>12}", unit="req") as bar:
                results = asyncio.run(run_policy(f"http://127.0.0.1:{port}", policy, sessions, args, bar))
            rows.append(summarize(policy, results))
        print()
        print(f"{'policy':<14}{'requests':>9}{'hit rate':>10}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}")
        for row in rows:
            print(f"{row['policy']:<14}{row['requests']:>9}{row['hit_rate']:>10.1%}"
                  f"{row['ttft_ms_p50']:>13.1f}{row['ttft_ms_p99']:>13.1f}")
        for row in rows:
            print(json.dumps({"demo": "multiturn_http", **{k: (round(v, 4) if isinstance(v, float) else v)
                                                          for k, v in row.items() if not k.startswith("_")}}))
        if args.plot:
            plot(rows, args.plot)
            print(f"wrote {args.plot}")
    finally:
        print("shutting down...", flush=True)
        local.shutdown()
    return 0
