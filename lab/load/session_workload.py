"""A chat-sessions workload over HTTP: sessions that arrive, read their own document, think and come back.

Where ``lab.load.chat_workload`` starts every chat in the same
millisecond behind one long system prompt with repeated questions, this one is
closer to what a prefix cache must survive in service:

- ``sessions`` sessions, each with its OWN document of about ``doc_tokens``
  tokens (English-like text drawn from the seed, sized with the model's
  tokenizer; distinct per session) behind a short system prompt every session
  shares (``system``);
- Poisson arrivals: the first session starts at once, each next one an
  exponential gap of mean ``arrival_s`` after the one before;
- ``turns`` turns per session; between a reply and the next question an
  exponential think time of mean ``think_s``, except that a share
  ``long_pause_share`` of the pauses is long (exponential of mean
  ``long_pause_s``): the session's prefix has gone cold by then, which is where
  a cache's lower tiers earn their keep. Every ``Turn`` records whether it came
  after a long pause;
- distinct questions (no question repeats anywhere in the run) and a
  ``max_tokens`` per turn drawn from ``min_tokens..max_tokens``;
- the ``X-Session-Id: <session id>`` header on every request (unless
  ``session_header=False``): this app's ingress prefetches a session's prefix
  when its request arrives; other servers ignore it.

The schedule is a pure function of the seed and the parameters
(``plan_sessions``): every arm of a benchmark gets the same sessions, documents,
questions, arrival times, pauses and reply lengths. The client
(``run_sessions``) streams ``/v1/chat/completions`` (``temperature`` 0,
``stream_options.include_usage``), sends the model's real reply back with the
next question and measures each request as ``chat_workload.ask_turn`` does: a
request that gets an error status, an error event or a stream without its end
counts as failed and ends its session.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from lab.bench.common import percentile, rounded
from lab.load.chat_workload import WORDS, Turn, WorkloadResult, ask_turn

SESSION_HEADER = "X-Session-Id"
MIN_REPLY_TOKENS = 16   # the low end of a turn's max_tokens (or --max-tokens itself when lower)

TOPICS = tuple(sorted(set(WORDS) - {"the", "every", "while", "about", "and", "keeps", "ask", "short"}))
QUESTION_TEMPLATES = (
    "What does the document say about the {a}?",
    "How are the {a} and the {b} related in the text?",
    "Summarize the part about the {a} in one sentence.",
    "Which {a} is mentioned closest to the {b}?",
    "Why would a reader care about the {a} here?",
    "List two facts about the {a} from the document.",
    "Is there anything surprising about the {a} and the {b}?",
    "Explain the role of the {a} as the document describes it.",
    "Compare the {a} with the {b} in a few words.",
    "What would change if the {a} were gone?",
)


@dataclass(frozen=True)
class PlannedTurn:
    turn: int                 # 0 for a session's first turn
    question: str
    max_tokens: int
    pause_s: float            # the think time before this turn is sent (0.0 for the first)
    after_long_pause: bool    # the pause before it was a long one


@dataclass(frozen=True)
class PlannedSession:
    session: int
    session_id: str           # what the X-Session-Id header says
    start_s: float            # arrival, seconds after the workload's start
    document: str
    turns: tuple[PlannedTurn, ...]

    def first_message(self, turn: PlannedTurn) -> str:
        """The first user message: the session's document, then its first question."""
        return f"Here is a document.\n\n{self.document}\n\n{turn.question}"


def _exp(rng: random.Random, mean: float) -> float:
    """An exponential draw of mean ``mean`` (0 for a mean of 0: no wait at all)."""
    return rng.expovariate(1.0 / mean) if mean > 0 else 0.0


def english_text(tokenizer, tokens: int, rng: random.Random, first: str) -> str:
    """Sentences of ``WORDS`` after ``first`` until the text is about ``tokens`` tokens of
    ``tokenizer`` (as ``chat_workload.system_prompt`` sizes its prompt), never above them
    unless ``first`` alone is."""
    words: list[str] = [first]
    while len(tokenizer.encode(" ".join(words))) < tokens:
        sentence = [rng.choice(WORDS) for _ in range(rng.randint(6, 12))]
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += "."
        words.extend(sentence)
    while len(words) > 1 and len(tokenizer.encode(" ".join(words))) > tokens:
        words.pop()
    return " ".join(words)


def document(tokenizer, tokens: int, seed: int, session: int) -> str:
    """Session ``session``'s own document: its title, then text of its own seed."""
    rng = random.Random(f"{seed}:document:{session}")
    return english_text(tokenizer, tokens, rng, f"Document {session + 1}: field notes of visit {rng.randrange(10**6)}.")


def distinct_questions(n: int, rng: random.Random) -> list[str]:
    """``n`` questions, no two alike (a template and one or two topics each, drawn from ``rng``)."""
    seen: set[str] = set()
    out: list[str] = []
    while len(out) < n:
        template = rng.choice(QUESTION_TEMPLATES)
        a, b = rng.sample(TOPICS, 2)
        question = template.format(a=a, b=b)
        if question in seen:   # drawn before: once the space thins out, make it unique
            question = f"{question[:-1]} (question {len(out) + 1})?"
        if question not in seen:
            seen.add(question)
            out.append(question)
    return out


def plan_sessions(tokenizer, *, sessions: int, turns: int, doc_tokens: int, arrival_s: float, think_s: float,
                  long_pause_share: float, long_pause_s: float, max_tokens: int, seed: int,
                  min_tokens: int = MIN_REPLY_TOKENS) -> list[PlannedSession]:
    """The whole workload, decided up front from ``seed`` (the same for every server).

    Each concern draws from its own stream (arrivals, pauses, questions, reply
    lengths, each document), so changing one parameter leaves the others' draws
    where they were."""
    if sessions < 1 or turns < 1 or max_tokens < 1:
        raise ValueError("sessions, turns and max_tokens must be >= 1")
    if not 0.0 <= long_pause_share <= 1.0:
        raise ValueError(f"long_pause_share must be in [0, 1], got {long_pause_share}")
    for name, value in (("arrival_s", arrival_s), ("think_s", think_s), ("long_pause_s", long_pause_s)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    arrivals = random.Random(f"{seed}:arrivals")
    pauses = random.Random(f"{seed}:pauses")
    lengths = random.Random(f"{seed}:max_tokens")
    questions = iter(distinct_questions(sessions * turns, random.Random(f"{seed}:questions")))
    low = min(min_tokens, max_tokens)
    out, start = [], 0.0
    for i in range(sessions):
        if i:
            start += _exp(arrivals, arrival_s)
        planned = []
        for t in range(turns):
            long = t > 0 and pauses.random() < long_pause_share
            pause = 0.0 if t == 0 else _exp(pauses, long_pause_s if long else think_s)
            planned.append(PlannedTurn(t, next(questions), lengths.randint(low, max_tokens), pause, long))
        out.append(PlannedSession(i, f"session-{seed}-{i:03d}", start, document(tokenizer, doc_tokens, seed, i),
                                  tuple(planned)))
    return out


@dataclass
class SessionsResult(WorkloadResult):
    """``WorkloadResult`` and the fields of this workload (see ``session_fields``)."""

    sessions: list[PlannedSession] = field(default_factory=list)

    def summary(self) -> dict:
        return {**super().summary(), **session_fields(self.turns)}


def session_fields(turns: list[Turn]) -> dict:
    """Later turns' (second and after) share of prompt tokens the server had cached, and TTFT
    p50/p99 of the first turns, the later ones and those after a long pause (None where none)."""
    ok = [t for t in turns if t.ok]
    later = [t for t in ok if t.turn > 0]
    prompt = sum(t.prompt_tokens for t in later)

    def ms(selected: list[Turn], q: float) -> float | None:
        values = [t.ttft_s for t in selected if t.ttft_s is not None]
        return rounded(percentile(values, q) * 1e3, 1) if values else None

    first, paused = [t for t in ok if t.turn == 0], [t for t in ok if t.after_long_pause]
    return {"later_turns_cached_share": rounded(sum(t.cached_tokens for t in later) / prompt, 4) if prompt else None,
            "ttft_ms_first_turn_p50": ms(first, 50), "ttft_ms_first_turn_p99": ms(first, 99),
            "ttft_ms_later_turns_p50": ms(later, 50), "ttft_ms_later_turns_p99": ms(later, 99),
            "ttft_ms_after_long_pause_p50": ms(paused, 50), "ttft_ms_after_long_pause_p99": ms(paused, 99),
            "long_pause_turns": len(paused)}


async def run_sessions(base: str, model: str, plan: list[PlannedSession], *, system: str,
                       session_header: bool = True, timeout_s: float = 600.0,
                       api_key: str | None = None, sampling: dict | None = None) -> SessionsResult:
    """Run ``plan`` against the OpenAI-compatible server at ``base`` (sessions arrive at their
    ``start_s``, wait each turn's ``pause_s`` after the reply before it); every Turn in the
    order it ended. ``api_key``: sent as the bearer token (the tenant's key); ``sampling``: each
    request's sampling fields (``ask_turn``; default greedy)."""
    import httpx

    result = SessionsResult(sessions=list(plan))

    async def one_session(s: PlannedSession, http, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + s.start_s - time.perf_counter()))
        headers = {SESSION_HEADER: s.session_id} if session_header else None
        messages = [{"role": "system", "content": system}]
        for planned in s.turns:
            if planned.turn:
                await asyncio.sleep(planned.pause_s)
            content = s.first_message(planned) if planned.turn == 0 else planned.question
            messages.append({"role": "user", "content": content})
            turn, reply = await ask_turn(http, model, messages, s.session, planned.turn, planned.max_tokens,
                                         headers=headers, sampling=sampling)
            turn.after_long_pause = planned.after_long_pause
            result.turns.append(turn)
            if not turn.ok:
                return
            messages.append({"role": "assistant", "content": reply})

    limits = httpx.Limits(max_connections=len(plan) + 4, max_keepalive_connections=len(plan) + 4)
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with httpx.AsyncClient(base_url=base, timeout=timeout_s, limits=limits, headers=auth) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*[one_session(s, http, t0) for s in plan])
        result.wall_s = time.perf_counter() - t0
    return result
