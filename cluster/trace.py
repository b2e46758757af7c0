"""Mooncake-format traces: loading, validation, synthesis and token expansion.

A trace is JSON lines, one request each: ``timestamp`` (ms), ``input_length``,
``output_length``, ``hash_ids``. Each hash id stands for one block of
``trace_block_tokens`` tokens (512 in the published Mooncake traces), chained:
two requests sharing their first k ids share a prefix of k blocks.

Expansion to tokens: every hash id becomes ``block_tokens`` token ids drawn
from a generator seeded by that id (so shared ids give identical tokens in
every process), the last block cut so that lengths scale with ``input_length``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from cluster.errors import InvalidInputError

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(slots=True)
class TraceRecord:
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]
    session: int | None = None

    def to_json(self) -> str:
        rec = {"timestamp": self.timestamp, "input_length": self.input_length,
               "output_length": self.output_length, "hash_ids": self.hash_ids}
        if self.session is not None:
            rec["session"] = self.session
        return json.dumps(rec)


def parse_record(obj: dict, where: str) -> TraceRecord:
    try:
        ts, inp, out, ids = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
    except KeyError as exc:
        raise InvalidInputError(f"{where}: missing field {exc.args[0]!r}") from None
    if not isinstance(ts, (int, float)) or ts < 0:
        raise InvalidInputError(f"{where}: timestamp must be a non-negative number, got {ts!r}")
    for name, value in (("input_length", inp), ("output_length", out)):
        if not isinstance(value, int) or value < 0:
            raise InvalidInputError(f"{where}: {name} must be a non-negative integer, got {value!r}")
    if not isinstance(ids, list) or not all(isinstance(h, int) and h >= 0 for h in ids):
        raise InvalidInputError(f"{where}: hash_ids must be a list of non-negative integers")
    if inp > 0 and not ids:
        raise InvalidInputError(f"{where}: input_length {inp} > 0 but hash_ids is empty")
    return TraceRecord(float(ts), inp, out, ids, obj.get("session"))


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRecord]:
    path = Path(path)
    if not path.is_file():
        raise InvalidInputError(f"trace file not found: {path}")
    records = []
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if limit is not None and len(records) >= limit:
                break
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidInputError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise InvalidInputError(f"{path}:{lineno}: expected a JSON object")
            records.append(parse_record(obj, f"{path}:{lineno}"))
    return records


def synthetic_multiturn(num_records: int = 20_000, *, seed: int = 0, block_tokens: int = 16,
                        num_system_prompts: int = 8, system_blocks: tuple[int, int] = (40, 120),
                        turn_blocks: tuple[int, int] = (3, 20), turns: tuple[int, int] = (2, 12),
                        concurrent_sessions: int = 64, think_ms: tuple[int, int] = (30_000, 120_000),
                        output_blocks: tuple[int, int] = (1, 10)) -> list[TraceRecord]:
    """A multi-turn chat trace in Mooncake format.

    Groups of sessions share a system prompt; each turn resends the whole
    conversation plus a new user message, so a turn's hash ids extend the
    previous turn's (the previous reply becomes part of the prefix).
    """
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    systems = [fresh(rng.randint(*system_blocks)) for _ in range(num_system_prompts)]
    records: list[TraceRecord] = []
    clock = 0.0
    # Active sessions: [session id, hash ids so far, turns left, time of next turn]
    active: list[list] = []
    session_id = 0
    while len(records) < num_records:
        while len(active) < concurrent_sessions:
            active.append([session_id, list(rng.choice(systems)), rng.randint(*turns), clock + rng.uniform(0, 5000)])
            session_id += 1
        active.sort(key=lambda s: s[3])
        sess = active[0]
        clock = max(clock, sess[3])
        ids = sess[1] + fresh(rng.randint(*turn_blocks))
        out_blocks = rng.randint(*output_blocks)
        tail = rng.randint(1, block_tokens)
        records.append(TraceRecord(round(clock, 3), (len(ids) - 1) * block_tokens + tail,
                                   out_blocks * block_tokens, ids, sess[0]))
        sess[1] = ids + fresh(out_blocks)  # the reply joins the conversation
        sess[2] -= 1
        sess[3] = clock + rng.uniform(*think_ms)
        if sess[2] == 0:
            active.pop(0)
    return records


def write_trace(records: list[TraceRecord], path: str | Path) -> None:
    with Path(path).open("w") as fh:
        for rec in records:
            fh.write(rec.to_json() + "\n")


class TokenExpander:
    """Turns hash ids into token ids, memoising each block (ids repeat a lot)."""

    def __init__(self, block_tokens: int, vocab_size: int = 32_000,
                 trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS):
        if block_tokens <= 0 or trace_block_tokens <= 0 or vocab_size <= 1:
            raise InvalidInputError("block_tokens, trace_block_tokens and vocab_size must be positive")
        self.block_tokens = block_tokens
        self.vocab_size = vocab_size
        self.trace_block_tokens = trace_block_tokens
        self._blocks: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        toks = self._blocks.get(hash_id)
        if toks is None:
            rng = np.random.default_rng(hash_id)
            toks = rng.integers(0, self.vocab_size, self.block_tokens).tolist()
            self._blocks[hash_id] = toks
        return toks

    def num_tokens(self, rec: TraceRecord) -> int:
        if not rec.hash_ids:
            return 0
        tb, bt = self.trace_block_tokens, self.block_tokens
        last = rec.input_length - (len(rec.hash_ids) - 1) * tb
        last = min(max(last, 1), tb)
        return (len(rec.hash_ids) - 1) * bt + max(1, -(-last * bt // tb))

    def tokens(self, rec: TraceRecord) -> list[int]:
        out: list[int] = []
        for h in rec.hash_ids:
            out += self.block(h)
        del out[self.num_tokens(rec):]
        return out

    def iter_tokens(self, records: list[TraceRecord]) -> Iterator[list[int]]:
        for rec in records:
            yield self.tokens(rec)
