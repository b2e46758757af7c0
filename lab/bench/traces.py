"""Mooncake-format traces of different shapes, for routing replays.

Every shape is a stream of sessions starting as a Poisson process. A session
picks a shared prefix (a system prompt, a tool catalogue, a document) by
Zipf popularity and sends one or more turns; each turn resends everything so
far plus a new message, so its hash ids extend the previous turn's. Hash ids
follow the tokens: a block wholly inside a shared prefix has that prefix's id,
every other full block its session's own id, a partial last block a fresh id
per request. Shapes (``SHAPES``):

- ``conversation``: chat; 40 system prompts of 500-3,000 tokens, 20% single
  requests, otherwise ~8 turns with a minute of thinking between them.
- ``tool_agent``: agent loops; 12 long tool catalogues (3,000-8,000 tokens),
  ~15 steps a session, each appending a tool result (~800 tokens) and a short
  call (~80), a few seconds apart.
- ``long_system``: 8 very long shared prompts (RAG corpora, few-shot sets:
  12,000-30,000 tokens) with one or two short questions each.
- ``one_off``: single requests with little reuse: 2,000 distinct short system
  prompts, uniform popularity.
- ``bursts``: a new document (2,000-10,000 tokens, never seen before) sent
  as 4-16 sibling requests at the same instant (n samples, a map step, parallel
  tool calls), each with its own question, then a follow-up turn on one of
  them: the siblings arrive before any KV event of the first.
- ``mixed``: all of the above, interleaved.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from cluster.errors import InvalidInputError
from cluster.trace import TraceRecord


@dataclass(frozen=True)
class Shape:
    num_prefixes: int = 40                       # shared prefixes (system prompts, catalogues, documents)
    zipf_s: float = 1.0                          # their popularity
    prefix_tokens: tuple[int, int] = (500, 3000)
    mean_turns: float = 8.0                      # mean requests per session, over all sessions
    single_shot: float = 0.2                     # fraction of one-request sessions
    message_median: int = 250                    # new user text per turn (lognormal median)
    reply_median: int = 450                      # model reply that joins the context
    think_mean_s: float = 60.0                   # between turns (exponential)
    burst: tuple[int, int] = (0, 0)              # siblings of a fresh document at one instant (0: none)
    burst_doc_tokens: tuple[int, int] = (2000, 10_000)


SHAPES: dict[str, Shape] = {
    "conversation": Shape(),
    "tool_agent": Shape(num_prefixes=12, prefix_tokens=(3000, 8000), mean_turns=15.0, single_shot=0.05,
                        message_median=800, reply_median=80, think_mean_s=3.0),
    "long_system": Shape(num_prefixes=8, zipf_s=0.8, prefix_tokens=(12_000, 30_000), mean_turns=1.5,
                         single_shot=0.6, message_median=120, reply_median=300, think_mean_s=30.0),
    "one_off": Shape(num_prefixes=2000, zipf_s=0.0, prefix_tokens=(200, 1500), mean_turns=1.1,
                     single_shot=0.92, message_median=600, reply_median=300, think_mean_s=20.0),
    "bursts": Shape(num_prefixes=20, prefix_tokens=(500, 2000), mean_turns=9.0, single_shot=0.0,
                    message_median=150, reply_median=300, think_mean_s=30.0, burst=(4, 16)),
}
MIXED = ("conversation", "tool_agent", "long_system", "one_off", "bursts")


def shape_trace(shape: str | Shape, num_records: int, *, seed: int = 0, block_tokens: int = 512,
                rate: float = 20.0) -> list[TraceRecord]:
    """``num_records`` requests of one shape (a name of ``SHAPES``, ``mixed`` or a
    ``Shape``), ``rate`` requests per second on average, sorted by time."""
    if num_records <= 0 or block_tokens <= 0 or rate <= 0:
        raise InvalidInputError("num_records, block_tokens and rate must be positive")
    if shape == "mixed":
        # Each shape numbers its ids from its own base, below 2**32 (the cache's uint32 keys).
        parts = [_sessions(SHAPES[name], -(-num_records // len(MIXED)), seed + k, block_tokens, rate / len(MIXED),
                           (k + 1) << 28) for k, name in enumerate(MIXED)]
        merged = sorted((r for p in parts for r in p), key=lambda r: r.timestamp)
        return merged[:num_records]
    return _sessions(SHAPES[shape] if isinstance(shape, str) else shape, num_records, seed, block_tokens, rate, 0)


def _sessions(sp: Shape, num_records: int, seed: int, bt: int, rate: float, id_base: int) -> list[TraceRecord]:
    rng = random.Random(seed)
    next_id = id_base

    def fresh() -> int:
        nonlocal next_id
        next_id += 1
        return next_id - 1

    def lognormal(median: int, lo: int, hi: int) -> int:
        return int(min(hi, max(lo, rng.lognormvariate(math.log(median), 0.8))))

    prefixes = []
    for _ in range(sp.num_prefixes):
        length = rng.randint(*sp.prefix_tokens)
        prefixes.append((length, [fresh() for _ in range(length // bt)]))
    weights = [1.0 / (k + 1) ** sp.zipf_s for k in range(sp.num_prefixes)]
    multi_turns = max(1.0, (sp.mean_turns - sp.single_shot) / (1 - sp.single_shot)) if sp.single_shot < 1 else 1.0
    burst_mean = sum(sp.burst) / 2 if sp.burst[1] else 0
    session_rate = rate / (sp.mean_turns + burst_mean)
    records: list[tuple[float, int, TraceRecord]] = []
    start, session = 0.0, 0

    def emit(t: float, length: int, full: list[int], sess: int) -> None:
        ids = full + ([fresh()] if length % bt else [])
        records.append((t, len(records), TraceRecord(round(t * 1000, 3), length, lognormal(sp.reply_median, 10, 2000),
                                                     ids, sess)))

    def grow(full: list[int], length: int) -> None:
        while len(full) < length // bt:
            full.append(fresh())

    while True:
        start += rng.expovariate(session_rate)
        if session % 500 == 0 and len(records) >= num_records:
            records.sort(key=lambda r: (r[0], r[1]))
            if records[num_records - 1][0] < start:
                break
        length, full = rng.choices(prefixes, weights)[0]
        full = list(full)
        t = start
        if sp.burst[1]:
            # A fresh document after the system prompt, then k siblings at once.
            length += rng.randint(*sp.burst_doc_tokens)
            grow(full, length)
            for _ in range(rng.randint(*sp.burst)):
                q = lognormal(sp.message_median, 20, 2000)
                sib = list(full)
                grow(sib, length + q)
                emit(t, length + q, sib, session)
            t += rng.expovariate(1 / sp.think_mean_s)
        turns = 1 if rng.random() < sp.single_shot else min(64, 1 + int(rng.expovariate(1 / (multi_turns - 1 + 1e-9))))
        for _ in range(turns):
            length += lognormal(sp.message_median, 20, 8000)
            grow(full, length)
            emit(t, length, full, session)
            length += records[-1][2].output_length
            grow(full, length)
            t += rng.expovariate(1 / sp.think_mean_s)
        session += 1
    return [r for _, _, r in records[:num_records]]


def conversation_trace(num_records: int = 100_000, *, seed: int = 0, block_tokens: int = 512, rate: float = 20.0,
                       **shape) -> list[TraceRecord]:
    """The ``conversation`` shape, optionally with some of its fields changed."""
    return _sessions(replace(SHAPES["conversation"], **shape), num_records, seed, block_tokens, rate, 0)
