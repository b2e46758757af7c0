"""A multi-turn chat workload over HTTP, the same for every server it is pointed at.

``sessions`` chats start together; each shares one system prompt of about
``system_tokens`` tokens, asks ``turns`` questions, streams each answer
(``max_tokens``, greedy), sends the model's real reply back with the next
question, and waits ``think_s`` between turns. Every request is measured
from the client's side: time to the first streamed token, time to the end,
the usage the server reports (prompt, completion and cached tokens). A
request that gets an error status, an error event or a stream without its
end counts as failed and ends its session.

Any OpenAI-compatible server will do (``/v1/chat/completions`` with
``stream_options.include_usage``); the same seed gives every server the same
questions.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from lab.bench.common import percentile, rounded
from serve_app.timing import TTFT_PARTS

WORDS = ("the platform keeps every answer short and precise while customers ask about latency cost cache tokens "
         "context windows replicas routing memory pressure trains museums recipes soup bread apples vegetables "
         "seasons budgets prices timetables night regional lines kitchen allergens nuts gluten milk eggs grams "
         "millilitres travellers stations tickets schedules evening morning coffee breakfast dinner lunch garden "
         "weather rain snow summer winter spring autumn river mountain city village harbour bridge castle "
         "library school market shop bakery pharmacy hospital office factory warehouse airport harbour").split()
QUESTIONS = [
    "What is a prefix cache?", "How do I make a quick tomato soup?", "Where should I go in Italy in spring?",
    "Why is the second turn of a chat faster?", "Can you suggest a vegetarian dinner?",
    "How long is the train from Paris to Lyon?", "What does time to first token mean?",
    "What can I bake with apples?", "Is Vienna expensive?", "How do replicas share KV blocks?",
    "What is a good breakfast for a busy morning?", "Which city has the best museums?",
    "Tell me more.", "Can you give an example?", "Why?", "And what else should I know?",
]


def system_prompt(tokenizer, tokens: int, seed: int) -> str:
    """English-like text of about ``tokens`` tokens of ``tokenizer`` (the same for every arm)."""
    rng = random.Random(seed)
    words: list[str] = ["You are a helpful assistant."]
    while len(tokenizer.encode(" ".join(words))) < tokens:
        words.extend(rng.choice(WORDS) for _ in range(8))
    while len(words) > 1 and len(tokenizer.encode(" ".join(words))) > tokens:
        words.pop()
    return " ".join(words)


@dataclass
class Turn:
    session: int
    turn: int
    ok: bool
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    started_at: float = 0.0            # time.monotonic() when it was sent
    worker_id: str | None = None       # the replica that answered (this app's prefix_cache field)
    cached_by_tier: dict = field(default_factory=dict)   # this app's cached_tokens_by_tier
    timing_ms: dict = field(default_factory=dict)        # this app's TTFT by part (serve_app.timing)
    after_long_pause: bool = False     # sent after a long think time (lab.load.session_workload)
    itl_s: list = field(default_factory=list)   # the gaps between its streamed pieces after the first
    timing_steps: dict = field(default_factory=dict)     # this app's wait in engine steps (serve_app.timing)


def turn_records(turns: list[Turn]) -> list[dict]:
    """Each request of a run as one JSON-ready record, in the order they were sent: its
    session and turn, ``sent_s`` (seconds after the run's first request), TTFT, e2e and its
    longest gap between streamed pieces (ms) and every gap (``itl_ms``: which of them make
    the run's ITL p99), its tokens, the cached ones by tier, and this
    app's TTFT parts (``timing_ms``) and wait in engine steps (``timing_steps``; empty for a
    server that reports neither). Where a request's time went, one by one
    (``bench serving --turns-out``)."""
    t0 = min((t.started_at for t in turns), default=0.0)

    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else round(seconds * 1e3, 1)

    return [{"session": t.session, "turn": t.turn, "ok": t.ok, "sent_s": round(t.started_at - t0, 3),
             "ttft_ms": ms(t.ttft_s), "e2e_ms": ms(t.e2e_s), "itl_ms_max": ms(max(t.itl_s, default=None)),
             "prompt_tokens": t.prompt_tokens, "completion_tokens": t.completion_tokens,
             "cached_tokens": t.cached_tokens, "cached_tokens_by_tier": t.cached_by_tier,
             "after_long_pause": t.after_long_pause, "timing_ms": t.timing_ms, "timing_steps": t.timing_steps,
             "error": t.error, "itl_ms": [round(g * 1e3, 1) for g in t.itl_s]}
            for t in sorted(turns, key=lambda t: t.started_at)]


@dataclass
class WorkloadResult:
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict:
        ok = [t for t in self.turns if t.ok]
        ttft = [t.ttft_s for t in ok if t.ttft_s is not None]
        first = [t.ttft_s for t in ok if t.turn == 0 and t.ttft_s is not None]
        later = [t.ttft_s for t in ok if t.turn > 0 and t.ttft_s is not None]
        e2e = [t.e2e_s for t in ok if t.e2e_s is not None]
        tpot = [(t.e2e_s - t.ttft_s) / (t.completion_tokens - 1) for t in ok
                if t.e2e_s is not None and t.ttft_s is not None and t.completion_tokens > 1]
        prompt = sum(t.prompt_tokens for t in ok)
        gaps = [g for t in ok for g in t.itl_s]

        def ms(values: list[float], q: float) -> float | None:
            return rounded(percentile(values, q) * 1e3, 1) if values else None

        return {"requests": len(self.turns), "failed": len(self.turns) - len(ok), "wall_s": rounded(self.wall_s, 2),
                "output_tokens_per_s": rounded(sum(t.completion_tokens for t in ok) / self.wall_s, 2)
                if self.wall_s else None,
                "ttft_ms_p50": ms(ttft, 50), "ttft_ms_p99": ms(ttft, 99),
                "ttft_ms_first_turn_p50": ms(first, 50), "ttft_ms_first_turn_p99": ms(first, 99),
                "ttft_ms_later_turns_p50": ms(later, 50), "ttft_ms_later_turns_p99": ms(later, 99),
                "e2e_ms_p50": ms(e2e, 50), "tpot_ms_p50": ms(tpot, 50), "tpot_ms_p99": ms(tpot, 99),
                # inter-token latency: every gap between two streamed pieces of a reply, and the
                # longest (a stream stalled while others ran)
                "itl_ms_p99": ms(gaps, 99), "itl_ms_max": rounded(max(gaps) * 1e3, 1) if gaps else None,
                "cached_token_share": rounded(sum(t.cached_tokens for t in ok) / prompt, 4) if prompt else 0.0,
                "errors": sorted({t.error for t in self.turns if t.error})[:5],
                **_ttft_parts(ok)}


def _ttft_parts(ok: list[Turn]) -> dict:
    """The median of each TTFT part over the first turns and over the later ones, where the
    server reports them (this app's ``prefix_cache.timing_ms``; nothing for other servers)."""
    out = {}
    for key, turns in (("ttft_parts_ms_first_turn_p50", [t for t in ok if t.turn == 0]),
                       ("ttft_parts_ms_later_turns_p50", [t for t in ok if t.turn > 0])):
        timed = [t.timing_ms for t in turns if t.timing_ms]
        if timed:
            out[key] = {part: rounded(percentile([float(m.get(part) or 0.0) for m in timed], 50), 1)
                        for part in TTFT_PARTS}
    return out


async def run_workload(base: str, model: str, *, sessions: int, turns: int, system: str, max_tokens: int,
                       think_s: float, seed: int, timeout_s: float = 600.0,
                       sampling: dict | None = None) -> WorkloadResult:
    import httpx

    rng = random.Random(seed)
    questions = [[rng.choice(QUESTIONS) for _ in range(turns)] for _ in range(sessions)]
    result = WorkloadResult()

    async def one_session(i: int, http) -> None:
        messages = [{"role": "system", "content": system}]
        for t, question in enumerate(questions[i]):
            if t:
                await asyncio.sleep(think_s)
            messages.append({"role": "user", "content": question})
            turn, reply = await ask(http, messages, i, t)
            result.turns.append(turn)
            if not turn.ok:
                return
            messages.append({"role": "assistant", "content": reply})

    async def ask(http, messages, i, t) -> tuple[Turn, str]:
        return await ask_turn(http, model, messages, i, t, max_tokens, sampling=sampling)

    limits = httpx.Limits(max_connections=sessions + 4, max_keepalive_connections=sessions + 4)
    async with httpx.AsyncClient(base_url=base, timeout=timeout_s, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*[one_session(i, http) for i in range(sessions)])
        result.wall_s = time.perf_counter() - t0
    return result


async def ask_turn(http, model: str, messages: list[dict], i: int, t: int, max_tokens: int,
                   headers: dict | None = None, sampling: dict | None = None) -> tuple[Turn, str]:
    """One streamed chat turn: its measurements and the reply's text (an error ends as a failed Turn);
    ``headers``: extra request headers (e.g. ``X-Session-Id``); ``sampling``: the request's
    sampling fields (e.g. ``{"temperature": 0.8, "top_p": 0.95}``; default greedy)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            **(sampling or {}), "stream": True, "stream_options": {"include_usage": True}}
    started, sent_at = time.perf_counter(), time.monotonic()
    ttft, text, usage, finished, cache, last, gaps = None, [], None, False, {}, None, []
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:200]
                return Turn(i, t, False, error=f"HTTP {resp.status_code}: {detail}", started_at=sent_at), ""
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    finished = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Turn(i, t, False, error=f"stream error: {chunk['error'].get('message', '')[:200]}",
                                started_at=sent_at), ""
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        now = time.perf_counter()
                        if ttft is None:
                            ttft = now - started
                        else:
                            gaps.append(now - last)
                        last = now
                        text.append(piece)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    cache = chunk.get("prefix_cache") or {}   # this app's: None from other servers
    except Exception as exc:   # no answer at all
        return Turn(i, t, False, error=f"{type(exc).__name__}: {str(exc)[:200]}", started_at=sent_at), ""
    if not finished or usage is None:
        return Turn(i, t, False, error="the stream ended without its usage and [DONE]", started_at=sent_at), ""
    cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
    return Turn(i, t, True, ttft, time.perf_counter() - started, int(usage.get("prompt_tokens", 0)),
                int(usage.get("completion_tokens", 0)), cached, None, sent_at, cache.get("worker_id"),
                dict(cache.get("cached_tokens_by_tier") or {}), dict(cache.get("timing_ms") or {}),
                itl_s=gaps, timing_steps=dict(cache.get("timing_steps") or {})), "".join(text)

