"""The replay's model of the world: the synthetic chat trace, the latency and service-time
models, and one simulated replica (cache, publisher, FIFO server, load reports).
``lab.bench.replay`` drives policies through it; see its docstring for the model."""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass

from cluster.cache.tiered import TierConfig, TieredCache
from cluster.errors import InvalidInputError
from cluster.routing.events import KVEventPublisher
from cluster.routing.policies import CostModel
from cluster.trace import TraceRecord


# ---------------------------------------------------------------- the trace
def synthetic_chat_trace(num_records: int = 100_000, *, seed: int = 0, block_tokens: int = 512,
                         rate: float = 20.0, num_system_prompts: int = 40, zipf_s: float = 1.0,
                         system_tokens: tuple[int, int] = (500, 3000), mean_turns: float = 8.0,
                         single_shot: float = 0.2, message_median: int = 250, reply_median: int = 450,
                         think_mean_s: float = 60.0) -> list[TraceRecord]:
    """Chat sessions in Mooncake format, ``rate`` requests per second on average.

    Sessions start as a Poisson process; each picks a system prompt by Zipf
    popularity; a fraction are single requests, the rest have a geometric
    number of turns. Each turn resends the conversation (system prompt, all
    messages and replies so far) plus a new message; users think for an
    exponential time between turns. Hash ids follow the tokens: a block wholly
    inside a shared system prompt has that prompt's id, every other full block
    of a session its own id, and a partial last block a fresh id per request.
    """
    if num_records <= 0 or block_tokens <= 0 or rate <= 0:
        raise InvalidInputError("num_records, block_tokens and rate must be positive")
    rng = random.Random(seed)
    next_id = 0

    def fresh() -> int:
        nonlocal next_id
        next_id += 1
        return next_id - 1

    systems = []
    for _ in range(num_system_prompts):
        length = rng.randint(*system_tokens)
        systems.append((length, [fresh() for _ in range(length // block_tokens)]))
    weights = [1.0 / (k + 1) ** zipf_s for k in range(num_system_prompts)]
    multi_turns = max(1.0, (mean_turns - single_shot) / (1 - single_shot))  # overall mean = mean_turns
    session_rate = rate / mean_turns

    def lognormal(median: int, lo: int, hi: int) -> int:
        return int(min(hi, max(lo, rng.lognormvariate(math.log(median), 0.8))))

    records: list[tuple[float, int, TraceRecord]] = []
    start, session = 0.0, 0
    while True:
        start += rng.expovariate(session_rate)
        if session % 2000 == 0 and len(records) >= num_records:
            records.sort(key=lambda r: (r[0], r[1]))
            if records[num_records - 1][0] < start:
                break
        sys_len, sys_ids = rng.choices(systems, weights)[0]
        turns = 1 if rng.random() < single_shot else min(64, 1 + int(rng.expovariate(1 / (multi_turns - 1 + 1e-9))))
        length, full = sys_len, list(sys_ids)
        t = start
        for turn in range(turns):
            length += lognormal(message_median, 20, 4000)
            while len(full) < length // block_tokens:
                full.append(fresh())
            ids = full + ([fresh()] if length % block_tokens else [])
            reply = lognormal(reply_median, 10, 2000)
            records.append((t, len(records), TraceRecord(round(t * 1000, 3), length, reply, ids, session)))
            length += reply
            while len(full) < length // block_tokens:
                full.append(fresh())
            t += rng.expovariate(1 / think_mean_s)
        session += 1
    return [r for _, _, r in records[:num_records]]


# ------------------------------------------------------------ the simulation
@dataclass(frozen=True)
class LatencyModel:
    prefill_tokens_per_s: float
    kv_bytes_per_token: int
    h2d_gbps: float
    disk_gbps: float
    transfer_gbps: float
    l3_gbps: float = 0.0   # reading from L3 into a replica (0: no L3)

    def cost_model(self, block_tokens: int) -> CostModel:
        per_tok = self.kv_bytes_per_token
        cold_s_per_tok = per_tok / (self.disk_gbps * 1e9) + per_tok / (self.h2d_gbps * 1e9)
        return CostModel(prefill_tokens_per_s=self.prefill_tokens_per_s,
                         warm_promote_tokens_per_s=self.h2d_gbps * 1e9 / per_tok,
                         cold_promote_tokens_per_s=1.0 / cold_s_per_tok,
                         transfer_tokens_per_s=self.transfer_gbps * 1e9 / per_tok, block_tokens=block_tokens,
                         l3_fetch_tokens_per_s=self.l3_gbps * 1e9 / per_tok)


@dataclass(frozen=True)
class ServiceModel:
    """What a replica really takes under production information: not the policy's formulas.

    The policy prices with ``believed`` (calibrated constants: a worker measures its
    prefill rate on a short fresh prompt, ``actors.calibration``). The simulator's
    prefill of ``n`` new tokens after ``c`` cached ones takes
    ``n / rate x (1 + (c + n / 2) / attention_tokens)``: attention's cost per token
    grows with the context it attends over (Llama-3-8B's linears cost 2 x 8e9 FLOPs a
    token, its attention 4 x 32 layers x 4,096 per token of context: equal at about
    30,500 tokens). Every service time (prefill, promotion, staging, pull) is then
    multiplied by lognormal noise drawn per request, the same draws for every policy.
    """

    believed: CostModel
    attention_tokens: float
    noise: list            # per request: (prefill, promotion, staging, pull) factors

    @staticmethod
    def draws(count: int, sigma: float, seed: int) -> list:
        rng = random.Random(seed * 1_000_003 + 17)
        if sigma <= 0:
            return [(1.0, 1.0, 1.0, 1.0)] * count
        return [tuple(rng.lognormvariate(0.0, sigma) for _ in range(4)) for _ in range(count)]

    def prefill_s(self, k: int, new_tokens: int, cached_tokens: int) -> float:
        n = max(1, new_tokens)
        base = n / self.believed.prefill_tokens_per_s
        if self.attention_tokens > 0:
            base *= 1.0 + (cached_tokens + n / 2) / self.attention_tokens
        return base * self.noise[k][0]


class Replica:
    """One replica's cache, publisher and FIFO server."""

    def __init__(self, worker_id: str, config: TierConfig):
        self.worker_id = worker_id
        self.cache = TieredCache(config, None, clock=_LogicalClock())
        self.publisher = KVEventPublisher(worker_id, self.cache.tree, block_tokens=1)
        self.cache.tree.listeners.append(self.publisher)
        self.free_at = 0.0          # when the server finishes its queue
        self.finishes: deque[float] = deque()
        self.area = 0.0             # integral of outstanding work (s) over time
        self.last_t = 0.0
        self.busy_s = 0.0
        # Production information: what its load report says, as the engine computes it.
        # Jobs in routing order, which is also start and prefill-end order (one FIFO server).
        self._routed: list[float] = []
        self._start: list[float] = []
        self._prefill_end: list[float] = []
        self._prompt_sum = [0]         # prefix sums of the jobs' prompt tokens
        self._decode: list = []        # heap of (decode end, job) for jobs past their prefill
        self._out: list[int] = []
        self._decode_end: list[float] = []
        self._p_routed = self._p_started = self._p_prefilled = 0
        self._a = self._b = 0.0        # sums over decoding jobs of out * end / length and out / length
        self._decoding = 0
        self.seen_tick: float | None = None
        self.phase = 0.0               # its report clock's offset (workers do not tick in step)

    def advance(self, now: float) -> None:
        a, d = max(0.0, self.free_at - self.last_t), now - self.last_t
        self.area += a * a / 2 if a <= d else d * (a - d / 2)
        self.last_t = now
        while self.finishes and self.finishes[0] <= now:
            self.finishes.popleft()

    def add_job(self, routed: float, start: float, prefill_end: float, decode_end: float, prompt: int,
                out: int) -> None:
        """A request routed here at ``routed``: it waits until ``start``, prefills until
        ``prefill_end`` and decodes until ``decode_end`` (jobs come in routing order)."""
        self._routed.append(routed)
        self._start.append(start)
        self._prefill_end.append(prefill_end)
        self._decode_end.append(decode_end)
        self._out.append(out)
        self._prompt_sum.append(self._prompt_sum[-1] + prompt)

    def report(self, t: float) -> tuple[int, int]:
        """(queued_tokens, running) as ``EngineLoop.measure_load`` computes them at ``t``:
        waiting requests count their whole prompt (cached tokens are known only at
        admission), running ones their remaining output tokens (all of them during the
        prefill, then fewer as the decode goes). Calls come with nondecreasing ``t``;
        each job is passed over a constant number of times."""
        n = len(self._routed)
        while self._p_routed < n and self._routed[self._p_routed] <= t:
            self._p_routed += 1
        while self._p_started < self._p_routed and self._start[self._p_started] <= t:
            self._p_started += 1
        while self._p_prefilled < self._p_started and self._prefill_end[self._p_prefilled] <= t:
            j = self._p_prefilled
            self._p_prefilled += 1
            length = self._decode_end[j] - self._prefill_end[j]
            if length > 0 and self._decode_end[j] > t:
                heapq.heappush(self._decode, (self._decode_end[j], j))
                self._a += self._out[j] * self._decode_end[j] / length
                self._b += self._out[j] / length
                self._decoding += 1
        while self._decode and self._decode[0][0] <= t:
            end, j = heapq.heappop(self._decode)
            length = end - self._prefill_end[j]
            self._a -= self._out[j] * end / length
            self._b -= self._out[j] / length
            self._decoding -= 1
        if not self._decode:   # no float drift left behind
            self._a = self._b = 0.0
        waiting = self._prompt_sum[self._p_routed] - self._prompt_sum[self._p_started]
        prefilling = range(self._p_prefilled, self._p_started)
        queued = waiting + sum(self._out[j] for j in prefilling) + max(0, round(self._a - t * self._b))
        return queued, self._decoding + len(prefilling)


class _LogicalClock:
    """Access order for LRU: the simulation has no meaningful wall clock."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def _tiers_between(match_nodes, start: int, end: int) -> list[int]:
    """Blocks of [start, end) on a matched path, by tier."""
    out, pos = [0, 0, 0], 0
    for n in match_nodes:
        lo, hi = max(pos, start), min(pos + len(n.key), end)
        if hi > lo:
            out[n.tier] += hi - lo
        pos += len(n.key)
    return out
