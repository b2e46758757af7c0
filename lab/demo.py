"""``prefix-cache demo``: the whole system on this machine, measured where it matters.

Starts a local Ray cluster of a head and two worker nodes on 127.0.0.1,
deploys the app with a real model (the embedded SmolLM2-135M-Instruct unless
``--model`` names another; one cache replica per node), asks it one question
and prints the answer, then drives a multi-turn chat workload through HTTP
(streaming, so TTFT is the first chunk; each turn sends the model's real
replies back) where the cache's point is visible: every session carries a
long document of its own, and together they hold more KV than the replicas'
HOT pools (``--hot-blocks`` each), so sessions are pushed out between their
turns. Three arms, caches flushed in between:

- ``cost`` router, tiered cache (HOT, WARM): what is pushed out waits in WARM;
- ``round_robin`` router, tiered cache: the same cache, without routing to it;
- ``cost`` router, ``drop`` (no WARM tier, the app redeployed): what is pushed
  out is gone, and the next turn recomputes it.

Before the first arm, one turn of every session runs unmeasured, spread over
the replicas (``warm_up``; ``--no-warm-up`` skips it): otherwise whichever arm
runs first pays the replicas' first forwards.

It prints hit rate, multi-turn reuse and TTFT p50/p99 side by side (no
request fails: under memory pressure requests wait or are preempted), writes
a PNG of the TTFT distributions, and shuts everything down.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

from lab.bench.common import emit, percentile, plot_cdfs
from serve_app.local import DEMO_WORKER, LocalCluster, free_port, prepare_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--document-words", type=int, default=450,
                   help="words of each session's own document (its long context)")
    p.add_argument("--hot-blocks", type=int, default=96,
                   help="HOT pool of each replica in 16-token blocks (the sessions together need more)")
    p.add_argument("--arms", default="cost:tiered,round_robin:tiered,cost:drop",
                   help="router:cache pairs to run, cache tiered or drop")
    p.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct; "
                                                  "'builtin' for the seeded test model)")
    p.add_argument("--max-tokens", type=int, default=12, help="reply tokens per turn of the workload")
    p.add_argument("--plot", default="prefix-cache-demo.png")
    p.add_argument("--port", type=int, default=0, help="HTTP port (default: a free one)")
    p.add_argument("--l3-pool-mb", type=int, default=1024,
                   help="MiB of the local L3 pool (Mooncake) the replicas share (0: no L3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                   help="measure the first arm on replicas that have not served the workload yet")


SYSTEM_PROMPTS = [
    "You are the support assistant of a company that runs a large LLM serving platform. Answer briefly and "
    "precisely. The platform keeps the KV cache of earlier requests in GPU memory, host memory and local "
    "disk, and a router sends each request to the replica that already holds the longest prefix of its "
    "prompt, weighing that against how busy each replica is. Customers ask about latency, cost, cache hit "
    "rates, tokens, context windows and how multi-turn chats are billed. Never invent prices; when you do "
    "not know, say so and point to the documentation.",
    "You are a friendly cooking assistant. Suggest simple recipes with common ingredients, give quantities "
    "in grams and millilitres, keep every answer under five sentences, and mention one tip that saves time. "
    "If a question is not about food or cooking, politely steer the conversation back to the kitchen. "
    "Prefer seasonal vegetables, explain any technique a beginner may not know, and warn about allergens "
    "such as nuts, gluten, milk and eggs whenever a recipe contains them.",
    "You are a travel assistant for trips in Europe. Recommend places, transport and budgets for travellers "
    "who move by train. Mention the best season to visit, one local dish to try and one museum or park. "
    "Keep answers short and practical, give prices as ranges in euros, and remind travellers to check "
    "timetables before they leave, because night trains and regional lines change every December.",
]


def make_sessions(args) -> list[dict]:
    from lab.load.chat_workload import QUESTIONS, WORDS

    rng = random.Random(args.seed)
    sessions = []
    for i in range(args.sessions):
        document = " ".join(rng.choice(WORDS) for _ in range(args.document_words))
        system = f"{SYSTEM_PROMPTS[i % len(SYSTEM_PROMPTS)]}\n\nNotes for this conversation (#{i}): {document}"
        sessions.append({"id": f"s{i}", "system": system,
                         "questions": [rng.choice(QUESTIONS) for _ in range(args.turns)]})
    return sessions


def ask_once(base: str, model: str, question: str, max_tokens: int = 48) -> str:
    """One chat completion over HTTP: the answer a user would see."""
    import httpx

    r = httpx.post(base + "/v1/chat/completions", timeout=300, json={
        "model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": question}]})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


async def run_arm(base: str, model: str, policy: str, sessions: list[dict], args, progress,
                  session_header: bool = False) -> list[dict]:
    """Every session's turns over HTTP (``args.concurrency`` requests at a time); with
    ``session_header`` each request also carries ``X-Session-Id``, which starts its session's
    prefetch when the headers arrive (the app's predictive swap-in)."""
    import httpx

    results: list[dict] = []
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        r = await client.post("/v1/admin/policy", json={"policy": policy})
        r.raise_for_status()
        (await client.post("/v1/cache/flush", json={})).raise_for_status()
        sem = asyncio.Semaphore(args.concurrency)

        async def chat(sess: dict) -> None:
            messages = [{"role": "system", "content": sess["system"]}]
            previous = 0   # tokens of the last turn's prompt and reply, which this prompt starts with
            for q in sess["questions"]:
                messages.append({"role": "user", "content": q})
                async with sem:
                    t0 = time.perf_counter()
                    ttft, text, usage = None, [], {}
                    headers = {"X-Session-Id": sess["id"]} if session_header else None
                    async with client.stream("POST", "/v1/chat/completions", headers=headers, json={
                            "model": model, "messages": messages, "max_tokens": args.max_tokens,
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
                cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
                results.append({"ttft_ms": ttft * 1e3, "prompt_tokens": usage.get("prompt_tokens", 0),
                                "cached_tokens": cached, "previous_tokens": previous})
                previous = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
                messages.append({"role": "assistant", "content": "".join(text)})
                progress.update(1)
                await asyncio.sleep(0)

        await asyncio.gather(*(chat(s) for s in sessions))
    return results


def warm_up(base: str, model: str, sessions: list[dict], args, progress) -> None:
    """The first turn of every session, unmeasured, round robin over the replicas; the first
    arm flushes what it left. Each replica's first forwards of the workload's shapes (the
    weights' and the KV pools' pages touched for the first time, the grammars built beside
    them at the lowest priority) land here instead of in whichever arm runs first. On a slow
    VM without it the first arm's TTFT p50 was 1.2x (round robin first) and 2.3x (cost first)
    the second's; with it, 0.9x and 2.1x (cost first, two runs): the cost arm's p50 varies
    there (411-1,323 ms over four runs, round robin's 456-725) with or without a warm-up."""
    first_turns = [{**s, "questions": s["questions"][:1]} for s in sessions]
    asyncio.run(run_arm(base, model, "round_robin", first_turns, args, progress))


def summarize(policy: str, cache: str, results: list[dict]) -> dict:
    ttfts = [r["ttft_ms"] for r in results]
    prompt = sum(r["prompt_tokens"] for r in results)
    follow_ups = [r for r in results if r["previous_tokens"]]
    previous = sum(r["previous_tokens"] for r in follow_ups)
    return {"policy": policy, "cache": cache, "requests": len(results),
            "hit_rate": sum(r["cached_tokens"] for r in results) / prompt if prompt else 0.0,
            # cached tokens / the previous turn's prompt + reply (which the new prompt starts with)
            "reuse_ratio": min(1.0, sum(min(r["cached_tokens"], r["previous_tokens"]) for r in follow_ups)
                               / previous) if previous else 0.0,
            "ttft_ms_p50": percentile(ttfts, 50), "ttft_ms_p99": percentile(ttfts, 99), "_ttfts": ttfts}


def plot(rows: list[dict], path: str) -> None:
    plot_cdfs([(f"{r['policy']}, {r['cache']} (hit {r['hit_rate']:.0%}, p50 {r['ttft_ms_p50']:.0f} ms, "
                f"p99 {r['ttft_ms_p99']:.0f} ms)", r["_ttfts"]) for r in rows],
              path, title="prefix-cache demo: tiered vs drop, cost router vs round robin",
              xlabel="time to first token over HTTP (ms, log scale)")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    arms = [tuple(a.split(":")) for a in args.arms.split(",")]
    if any(len(a) != 2 or a[1] not in ("tiered", "drop") for a in arms):
        raise ValueError(f"--arms takes router:cache pairs with cache tiered or drop, got {args.arms!r}")
    if args.l3_pool_mb < 0:
        raise ValueError(f"--l3-pool-mb must be >= 0 (0: no L3), got {args.l3_pool_mb}")
    print("preparing the model (the first run converts the embedded GGUF once, ~30 s)...", flush=True)
    model = prepare_model(args.model)
    print("starting a local Ray cluster (head + 2 worker nodes on 127.0.0.1)...", flush=True)
    local = LocalCluster(worker_nodes=2, l3_pool_mb=args.l3_pool_mb)
    port = args.port or free_port()   # once the cluster's processes hold their ports, not before
    try:
        print(f"deploying the app (3 cache replicas, {model}) on http://127.0.0.1:{port} ...", flush=True)
        worker = {**DEMO_WORKER, "hot_blocks": args.hot_blocks}
        if args.model is not None:
            worker["model"] = args.model
        # The demo flushes caches and switches policies between runs: admin endpoints on, on loopback.
        app = {"num_replicas": 3, "worker": worker, "admin_without_keys": True}
        local.deploy(app, port=port)
        base = f"http://127.0.0.1:{port}"
        question = "What is the capital of France? Answer in one sentence."
        print(f"\nQ: {question}\nA: {ask_once(base, model, question).strip()}\n", flush=True)
        sessions = make_sessions(args)
        if args.warm_up:
            with tqdm(total=len(sessions), desc=f"{'warm-up (unmeasured)':>20}", unit="req") as bar:
                warm_up(base, model, sessions, args, bar)
        rows, deployed = [], "tiered"
        for policy, cache in arms:
            if cache != deployed:   # the cache's tiers are the replicas' config: redeploy
                print(f"redeploying with the {cache} cache ...", flush=True)
                # drop: HOT only, as a GPU-only prefix cache (no WARM, no L3); tiered: all of it.
                drop = {"warm_blocks": 0, "l3_master": None} if cache == "drop" else \
                    {"warm_blocks": DEMO_WORKER["warm_blocks"]}
                local.deploy({**app, "worker": {**worker, **drop}}, port=port)
                deployed = cache
            with tqdm(total=args.sessions * args.turns, desc=f"{policy + ', ' + cache:>20}", unit="req") as bar:
                results = asyncio.run(run_arm(base, model, policy, sessions, args, bar))
            rows.append(summarize(policy, cache, results))
        print()
        print(f"{'router':<13}{'cache':<8}{'requests':>9}{'hit rate':>10}{'reuse':>8}{'TTFT p50 ms':>13}"
              f"{'TTFT p99 ms':>13}")
        for row in rows:
            print(f"{row['policy']:<13}{row['cache']:<8}{row['requests']:>9}{row['hit_rate']:>10.1%}"
                  f"{row['reuse_ratio']:>8.1%}{row['ttft_ms_p50']:>13.1f}{row['ttft_ms_p99']:>13.1f}")
        for row in rows:
            emit({"demo": "multiturn_http", **{k: (round(v, 4) if isinstance(v, float) else v)
                                               for k, v in row.items() if not k.startswith("_")}})
        if args.plot:
            plot(rows, args.plot)
            print(f"wrote {args.plot}")
    finally:
        print("shutting down...", flush=True)
        local.shutdown()
    return 0
