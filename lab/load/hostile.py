"""A hostile tenant for the load drill: requests no client should send, sent for the whole run.

Each body must get a 4xx, never a 5xx or no answer, and cost the service no
more than reading and refusing it; the good tenant's latency beside them
says whether one tenant's bad requests slow another's.
"""

from __future__ import annotations

import asyncio
import json


def hostile_bodies(model: str) -> list[tuple[str, bytes]]:
    """(name, raw JSON body) of requests no client should send: NaN and
    infinite sampling values, out-of-range and mistyped parameters, invalid
    Unicode, deep nesting, oversized prompts and stop lists, bodies that are
    not JSON. Each must get a 4xx, never a 5xx, and cost the service no more
    than reading and refusing it. (Legal but extreme values, such as a
    temperature of 1e-40, are real work and are tested as such in
    ``tests/serve/test_http.py``.)"""
    def body(**fields) -> bytes:
        return json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4, **fields}).encode()

    raw_prompt = b'{"model": %s, "prompt": "%s", "max_tokens": 4}'
    return [
        ("temperature_nan", body().replace(b'"max_tokens": 4', b'"max_tokens": 4, "temperature": NaN')),
        ("top_p_infinity", body().replace(b'"max_tokens": 4', b'"max_tokens": 4, "top_p": Infinity')),
        ("top_p_zero", body(top_p=0)),
        ("seed_2**70", body(seed=2 ** 70)),
        ("lone_surrogate", raw_prompt % (json.dumps(model).encode(), b"\\ud800")),
        ("nested_50k", b'{"model": ' + json.dumps(model).encode() + b', "prompt": ' + b"[" * 50_000
         + b"]" * 50_000 + b"}"),
        ("max_tokens_huge", body(max_tokens=10 ** 9)),
        ("prompt_too_long", body(prompt=[65] * 100_000)),
        ("token_out_of_vocab", body(prompt=[10 ** 9])),
        ("stop_list_100", body(stop=["x"] * 100)),
        ("wrong_types", body(max_tokens="four", stream="yes")),
        ("include_usage_no", body(stream=True, stream_options={"include_usage": "no"})),
        ("not_json", b"{not json"),
        ("empty_body", b""),
    ]


async def hostile_client(client, url: str, bodies: list[tuple[str, bytes]], headers: dict, stop: asyncio.Event,
                         seen: dict, timeout: float, interval_s: float = 0.0) -> None:
    """Send the hostile bodies in turn until ``stop``, one every ``interval_s`` at
    most; count each answer's status."""
    i = 0
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        next_at = loop.time() + interval_s
        name, raw = bodies[i % len(bodies)]
        i += 1
        try:
            r = await client.post(url, content=raw, headers={**headers, "content-type": "application/json"},
                                  timeout=timeout)
            status = str(r.status_code)
        except Exception as exc:   # no answer at all: as bad as a 5xx
            status = type(exc).__name__
        seen.setdefault(name, {}).setdefault(status, 0)
        seen[name][status] += 1
        if interval_s:
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, next_at - loop.time()))
            except TimeoutError:
                pass


def _hostile_report(concurrency: int, seen: dict, rate: float, wall_s: float) -> dict:
    if not concurrency:
        return {}
    by_status: dict[str, int] = {}
    for statuses in seen.values():
        for status, n in statuses.items():
            by_status[status] = by_status.get(status, 0) + n
    bad = sum(n for status, n in by_status.items() if not (status.isdigit() and int(status) < 500))
    sent = sum(by_status.values())
    return {"hostile_concurrency": concurrency, "hostile_rate_limit": rate or None,
            "hostile_requests_per_s": round(sent / wall_s, 1) if wall_s else None, "hostile_requests": sent,
            "hostile_by_status": dict(sorted(by_status.items())), "hostile_5xx_or_no_answer": bad,
            "hostile_by_kind": seen}
