"""Bounded load against a running app, optionally killing a replica or the directory mid-run; prints JSON.

    prefix-cache loadtest --url http://127.0.0.1:8000 --requests 300 --concurrency 16 \\
        --stream-fraction 0.5 --kill replica --kill-at 2 --address auto

Every request is classified from the client's side:

- ``completed``: a 200 with a whole body (a stream: a last chunk with a
  ``finish_reason`` and ``[DONE]``);
- ``failed_by_status``: a proper error, by HTTP status (a stream that ended
  with an OpenAI error event and ``[DONE]`` counts under ``stream_error``);
- ``cut_streams``: a stream that ended without ``[DONE]``, or without either a
  finish reason or an error event;
- ``lost``: neither a response nor an error (timed out, connection dropped
  before any response).

``--kill`` goes through Ray on the cluster at ``--address``: ``replica``
kills one ``CacheReplica`` (Serve starts another), ``directory`` kills the
directory actor (Ray restarts it). A replica kill waits, from ``--kill-at``
on, until some replica is running requests (as the directory last heard
from the workers' load reports) and kills the one of those with the most
work left, so the kill lands on requests in flight (if the load ends first, it kills a fixed
choice). With a kill the report adds:

- ``killed_worker``: the killed replica's worker id (null for the directory);
- ``in_flight_at_kill``: the requests that replica was running when it was
  killed, by its last load report (null for the directory);
- ``resumed``: requests the ingress resumed on another replica during the
  run: the increase of ``prefix_cache_resumed_requests_total`` over the Ray
  nodes' metrics endpoints from just before the load until one metrics report interval
  (``metrics_report_interval_ms``, 10 s by default) after the last request
  (null when no node's endpoint answered);
- ``killed_at_s``: when the kill landed, in seconds from the load's start;
- ``recovery_s``: the time from the kill until the app is whole again: the
  killed actor gone (the directory: back), as many replicas alive as
  before, and the directory's routing table listing every live replica and
  no longer the killed one (null without a kill, or past the limit);
- where it went (a replica kill): ``dropped_s``, from the kill until the
  directory no longer listed the killed worker; ``replacement``: the new
  replica's own start-up note (``started_after_kill_s``: until Serve started
  it; ``core_s``: loading the model, the kernels, L3 and registering, and
  ``core_parts``, those seconds by part: ``model_s``, ``cache_s``, ``l3_s``,
  ``engine_s`` (kernels, linear layouts), ``nixl_s``, ``rates_s`` (a peer's or
  calibrated), ``loop_s`` (engine thread, peer channel, registering);
  ``cuda_steps_s``; ``warmup_s``: pulling its peers' shared prefixes;
  ``ready_after_kill_s``: until it reported ready).

``rss_mib_before/after``: resident memory of the app's processes (the
Serve replicas and the directory, read from /proc: the cluster must run on
this machine), before the first request and after the last.

``--hostile-concurrency H``: meanwhile, H clients of a second tenant
(``--hostile-api-key``), ``--hostile-rate`` requests a second together
(default 10; 0: as fast as they can, a flood), send nothing but bad
requests (``hostile_bodies``:
NaN and denormal temperatures, a seed past 64 bits, a lone surrogate, JSON
nested 50,000 deep, oversized prompts and stop lists, ...) for the whole run;
``hostile_by_status`` counts their answers and ``hostile_5xx_or_no_answer``
must be 0. The good tenant's latency, compared with a run without them, says
whether one tenant's bad requests slow another's.

Traffic goes to 127.0.0.1 (or localhost) only, unless ``--allow-remote-host``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from urllib.parse import urlparse

from lab.bench.common import emit
from lab.load.faults import ClusterProbe
from lab.load.hostile import _hostile_report, hostile_bodies, hostile_client

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
RESUMED_SERIES = "ray_prefix_cache_resumed_requests_total"   # serve_app.metrics.resumed_requests, as Ray exports it


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--stream-fraction", type=float, default=0.5)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=128, help="tokens per prompt (shared prefixes of 64)")
    p.add_argument("--kill", choices=("replica", "directory"), default=None)
    p.add_argument("--kill-at", type=float, default=2.0, help="seconds after the first request")
    p.add_argument("--address", default="auto", help="Ray cluster of the app (for --kill and memory)")
    p.add_argument("--connect-timeout", type=float, default=30.0,
                   help="seconds to wait for the Ray cluster at --address before going on without it "
                        "(or failing, with --kill); default 30")
    p.add_argument("--namespace", default="prefix-cache", help="Ray namespace of the app's directory")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model id to send (default: the first of /v1/models)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request limit; past it a request is lost")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allow-remote-host", action="store_true", help="allow a --url host other than loopback")
    p.add_argument("--hostile-concurrency", type=int, default=0,
                   help="clients of a second tenant sending only bad requests (HOSTILE_BODIES) for the whole run")
    p.add_argument("--hostile-api-key", default=None, help="that tenant's API key (default: --api-key)")
    p.add_argument("--hostile-rate", type=float, default=10.0,
                   help="bad requests per second from all hostile clients together (0: as fast as they can)")


def check_url(url: str, allow_remote: bool) -> None:
    host = urlparse(url).hostname
    if host not in LOCAL_HOSTS and not allow_remote:
        raise SystemExit(f"loadtest sends traffic to 127.0.0.1 only; {host!r} needs --allow-remote-host")


# ----------------------------------------------------------------- the clients
class Tally:
    def __init__(self):
        self.completed = 0
        self.failed_by_status: dict[str, int] = {}
        self.lost = 0
        self.cut_streams = 0
        self.latencies_ms: list[float] = []

    def fail(self, status: str) -> None:
        self.failed_by_status[status] = self.failed_by_status.get(status, 0) + 1


async def one_request(client, url: str, body: dict, headers: dict, tally: Tally, timeout: float) -> None:
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            if not body.get("stream"):
                r = await client.post(url, json=body, headers=headers)
                if r.status_code == 200 and r.json().get("choices"):
                    tally.completed += 1
                    tally.latencies_ms.append((time.perf_counter() - t0) * 1000)
                elif r.status_code == 200:
                    tally.fail("200_without_choices")
                else:
                    tally.fail(str(r.status_code))
                return
            async with client.stream("POST", url, json=body, headers=headers) as r:
                if r.status_code != 200:
                    await r.aread()
                    tally.fail(str(r.status_code))
                    return
                done = finished = errored = False
                try:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            errored = True
                        elif any(c.get("finish_reason") for c in event.get("choices", ())):
                            finished = True
                except Exception:   # the body broke off mid-stream
                    pass
                if done and finished and not errored:
                    tally.completed += 1
                    tally.latencies_ms.append((time.perf_counter() - t0) * 1000)
                elif done and errored:
                    tally.fail("stream_error")
                else:
                    tally.cut_streams += 1
    except TimeoutError:
        tally.lost += 1
    except Exception:   # no response at all (connection refused or dropped before the status line)
        tally.lost += 1


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


async def run_load(url: str, *, requests: int, concurrency: int, stream_fraction: float, max_tokens: int = 32,
                   prompt_tokens: int = 128, kill: str | None = None, kill_at: float = 2.0,
                   probe: ClusterProbe | None = None, api_key: str | None = None, model: str | None = None,
                   timeout: float = 120.0, seed: int = 0, recovery_limit_s: float = 120.0,
                   hostile_concurrency: int = 0, hostile_api_key: str | None = None,
                   hostile_rate: float = 10.0) -> dict:
    """Run the load (and the kill, and the hostile tenant) and return the JSON report."""
    import httpx

    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    tally = Tally()
    killed: dict | None = None
    recovery: dict = {}
    rss_before = probe.rss_mib() if probe else None
    connections = concurrency + hostile_concurrency
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        if model is None:
            r = await client.get(url.rstrip("/") + "/v1/models", headers=headers)
            model = r.json()["data"][0]["id"]
        queue: asyncio.Queue = asyncio.Queue()
        for b in _bodies(rng, model, requests, prompt_tokens, max_tokens, stream_fraction):
            queue.put_nowait(b)
        endpoint = url.rstrip("/") + "/v1/completions"

        load_done = asyncio.Event()

        # Read before the load starts: scraping every node's endpoint can take a second or more on a
        # loaded machine, and read at kill time it pushed the kill to the load's tail, onto a replica
        # whose last request ended before the kill landed.
        # The replicas too: the GCS actor table a long-lived cluster returns (dead actors included) is slow.
        resumed_before = await asyncio.to_thread(probe.metric, RESUMED_SERIES) if kill else None
        replicas = await asyncio.to_thread(probe.replicas) if kill == "replica" else None

        async def killer():
            nonlocal killed
            await asyncio.sleep(kill_at)
            victim, in_flight = (await _busiest_replica(probe, replicas, load_done)) if replicas else (None, None)
            killed = await asyncio.to_thread(probe.kill, kill, victim, replicas)
            killed["at"], killed["wall"] = time.monotonic(), time.time()
            killed["s"] = round(time.perf_counter() - t0, 2)
            killed["in_flight"] = in_flight
            killed["resumed_before"] = resumed_before
            recovery["s"] = await asyncio.to_thread(_wait_whole, probe, killed, recovery_limit_s)

        stop, hostile_seen = asyncio.Event(), {}
        hostile_headers = {"Authorization": f"Bearer {hostile_api_key}"} if hostile_api_key else dict(headers)
        t0 = time.perf_counter()
        hostile = _start_hostile(client, endpoint, model, hostile_headers, hostile_concurrency, hostile_rate, stop,
                                 hostile_seen, timeout)
        tasks = [asyncio.create_task(_client_loop(client, endpoint, queue, headers, tally, timeout))
                 for _ in range(concurrency)]
        kill_task = asyncio.create_task(killer()) if kill else None
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        load_done.set()
        last_request = time.monotonic()
        stop.set()
        await asyncio.gather(*hostile)
        if kill_task is not None:
            await kill_task
    resumed = None
    if killed is not None:
        resumed = await asyncio.to_thread(_resumed_since, probe, killed["resumed_before"], last_request)
    return {"requests": requests, "completed": tally.completed, "failed_by_status": tally.failed_by_status,
            "lost": tally.lost, "cut_streams": tally.cut_streams,
            "latency_ms_p50": _percentile(tally.latencies_ms, 0.5),
            "latency_ms_p99": _percentile(tally.latencies_ms, 0.99),
            "recovery_s": recovery.get("s"), **_kill_report(kill, kill_at, killed, resumed),
            **_recovery_parts(probe, killed),
            "wall_s": round(wall, 2), "concurrency": concurrency, "stream_fraction": stream_fraction,
            "rss_mib_before": rss_before, "rss_mib_after": probe.rss_mib() if probe else None,
            **_hostile_report(hostile_concurrency, hostile_seen, hostile_rate, wall)}


def _bodies(rng: random.Random, model: str, requests: int, prompt_tokens: int, max_tokens: int,
            stream_fraction: float) -> list[dict]:
    """The load's completion bodies: prompts behind one of eight shared 64-token prefixes."""
    prefixes = [[rng.randrange(32, 200) for _ in range(64)] for _ in range(8)]
    bodies = []
    for _ in range(requests):
        prompt = rng.choice(prefixes) + [rng.randrange(32, 200) for _ in range(max(1, prompt_tokens - 64))]
        bodies.append({"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                       "temperature": 0.8, "stream": rng.random() < stream_fraction})
    return bodies


async def _client_loop(client, endpoint: str, queue: asyncio.Queue, headers: dict, tally: Tally,
                       timeout: float) -> None:
    """One client: the next body from the shared queue until it is empty."""
    while True:
        try:
            body = queue.get_nowait()
        except asyncio.QueueEmpty:
            return
        await one_request(client, endpoint, body, headers, tally, timeout)


def _start_hostile(client, endpoint: str, model: str, headers: dict, concurrency: int, rate: float,
                   stop: asyncio.Event, seen: dict, timeout: float) -> list[asyncio.Task]:
    """The hostile tenant's clients, together at ``rate`` bad requests per second."""
    bad = hostile_bodies(model)
    interval = concurrency / rate if rate > 0 else 0.0
    return [asyncio.create_task(hostile_client(client, endpoint, bad, headers, stop, seen, timeout, interval))
            for _ in range(concurrency)]


def _kill_report(kill: str | None, kill_at: float, killed: dict | None, resumed: int | None) -> dict:
    return {"kill": kill, "kill_at_s": kill_at if kill else None,
            "killed_worker": killed["worker_id"] if killed else None,
            "in_flight_at_kill": killed["in_flight"] if killed else None, "resumed": resumed,
            "killed_at_s": killed["s"] if killed else None}


async def _busiest_replica(probe: ClusterProbe, replicas: list, load_done: asyncio.Event):
    """Wait until one of ``replicas`` is running requests and return it with their count; once the
    load has ended with none running, (None, 0): the kill then takes a fixed choice."""
    while True:
        found = await asyncio.to_thread(probe.busiest_replica, replicas)
        if found is not None:
            return found
        if load_done.is_set():
            return None, 0
        await asyncio.sleep(0.02)


def _resumed_since(probe: ClusterProbe, before: dict[str, float] | None, last_request: float) -> int | None:
    """Requests resumed since ``before`` (the series of the ingress's resume counter), read once
    the last request's increments have been exported: one report interval (and a second) after it."""
    import ray

    try:
        interval_s = ray._config.metrics_report_interval_ms() / 1000
    except Exception:   # Ray's own default
        interval_s = 10.0
    time.sleep(max(0.0, last_request + interval_s + 1.0 - time.monotonic()))
    after = probe.metric(RESUMED_SERIES)
    if before is None or after is None:
        return None
    # Per series: an ingress process that started meanwhile counts from 0, one that is gone counts nothing.
    return int(sum(max(0.0, value - before.get(key, 0.0)) for key, value in after.items()))


def _wait_whole(probe: ClusterProbe, killed: dict, limit_s: float) -> float | None:
    while time.monotonic() - killed["at"] < limit_s:
        if "dropped_s" not in killed and killed.get("worker_id") not in probe.live_workers():
            killed["dropped_s"] = round(time.monotonic() - killed["at"], 2)
        if probe.whole(killed):
            return round(time.monotonic() - killed["at"], 2)
        time.sleep(0.1)
    return None


def _recovery_parts(probe: ClusterProbe | None, killed: dict | None) -> dict:
    """Where a replica kill's recovery went: the directory dropping the dead worker, then the
    replacement's start-up (its own note: from the kill until Serve started it, then its
    parts: the worker core, CUDA steps, warm-up) until it was ready."""
    if killed is None or killed.get("kind") != "replica" or probe is None:
        return {}
    notes = [n for n in probe.lifecycle("startup") if n.get("started_at", 0) >= killed["wall"]]
    note = min(notes, key=lambda n: n["started_at"]) if notes else None
    parts = {"dropped_s": killed.get("dropped_s"), "replacement": None}
    if note is not None:
        parts["replacement"] = {"worker_id": note["worker_id"],
                                "started_after_kill_s": round(note["started_at"] - killed["wall"], 2),
                                "core_s": note["core_s"], "core_parts": note.get("core_parts"),
                                "cuda_steps_s": note["cuda_steps_s"],
                                "warmup_s": note["warmup_s"],
                                "ready_after_kill_s": round(note["ready_at"] - killed["wall"], 2)}
    return parts


def run(args: argparse.Namespace) -> int:
    check_url(args.url, args.allow_remote_host)
    if not args.connect_timeout > 0:
        raise SystemExit(f"--connect-timeout must be a positive number of seconds, got {args.connect_timeout}")
    probe = None
    try:
        from actors.connect import connect

        connect(args.address, timeout_s=args.connect_timeout, log_to_driver=False, logging_level="ERROR")
        probe = ClusterProbe(args.namespace)
    except Exception as exc:
        if args.kill:
            raise SystemExit(f"--kill needs the app's Ray cluster at --address {args.address}: {exc}")
    report = asyncio.run(run_load(args.url, requests=args.requests, concurrency=args.concurrency,
                                  stream_fraction=args.stream_fraction, max_tokens=args.max_tokens,
                                  prompt_tokens=args.prompt_tokens, kill=args.kill, kill_at=args.kill_at,
                                  probe=probe, api_key=args.api_key, model=args.model, timeout=args.timeout,
                                  seed=args.seed, hostile_concurrency=args.hostile_concurrency,
                                  hostile_api_key=args.hostile_api_key, hostile_rate=args.hostile_rate))
    emit(report)
    return 0


__all__ = ["add_arguments", "run", "run_load", "ClusterProbe", "check_url"]
