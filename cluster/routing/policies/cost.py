"""The ``cost`` policy: cheapest expected TTFT, with what each option costs
the requests after it priced in.

A decision is two steps: ``candidates`` (which workers are worth pricing: the
least loaded worker of each group holding the same hit, plus what this router
sent in the last moment and the index cannot show yet) and ``price`` (each
candidate serving locally, and pulling the best holder's extra blocks first).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace
from itertools import compress, repeat
from operator import attrgetter, not_
from typing import Callable, Sequence

from cluster.errors import InvalidInputError
from cluster.routing.index import NO_HIT, GlobalIndex, PrefixHit
from cluster.routing.policies.base import CostModel, Decision, Policy, WorkerState, _alive

_QUEUED = attrgetter("queued_tokens")
_ID = attrgetter("worker_id")


@dataclass(frozen=True)
class CostOptions:
    """Knobs of the ``cost`` policy (see ``CostPolicy`` for what each prices).

    - ``dup_weight``: x the prefill time of each private block an option copies.
    - ``work_weight``: x the option's service time (capacity taken from later requests).
    - ``tie_s``: options within this of the cheapest (or within the mean queue
      wait of the live workers, if longer), copying no private block, are equal.
    - ``half_life``: decisions over which the recent work sent to a worker halves.
    - ``branch_memory``: prefixes remembered to find branch points (two generations).
    - ``inflight_s``: how long a routed request's blocks count as held by its
      worker before the worker's KV events can confirm it (0: off).
    """
    work_weight: float = 0.0
    dup_weight: float = 3.0
    tie_s: float = 0.05
    half_life: int = 2000
    branch_memory: int = 1 << 20
    inflight_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("work_weight", "dup_weight", "tie_s", "inflight_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v < 0:
                raise InvalidInputError(f"{name} must be a number >= 0, got {v!r}")
        for name in ("half_life", "branch_memory"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise InvalidInputError(f"{name} must be a positive integer, got {v!r}")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


class _BranchMemory:
    """Which blocks are shared prefixes: a block seen followed by two different
    blocks is a branch point (a system prompt, a few-shot header), so every
    block up to a request's last branch point is shared by several requests.

    Bounded: two generations of ``max_entries`` each; when the current one is
    full the older is forgotten (a prefix unused that long is likely gone from
    the caches too).
    """
    __slots__ = ("max_entries", "_cur", "_old")
    BRANCH = -1

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._cur: dict[int, int] = {}
        self._old: dict[int, int] = {}

    def observe(self, hashes: Sequence[int], full_blocks: int) -> int:
        """Record the chain's first ``full_blocks`` blocks; returns how many
        leading blocks are shared (up to the last branch point). A partial
        last block is left out: its id changes with every turn of a
        conversation, which would make every turn look like a branch."""
        cur, old, branch = self._cur, self._old, self.BRANCH
        shared = 0
        for i in range(min(len(hashes), full_blocks) - 1):
            h, nxt = hashes[i], hashes[i + 1]
            seen = cur.get(h)
            if seen is None:
                seen = old.get(h)
            if seen == branch:
                shared = i + 1
                if h not in cur:
                    cur[h] = branch
            elif seen is None:
                cur[h] = nxt
            elif seen != nxt:
                cur[h] = branch
                shared = i + 1
            elif h not in cur:
                cur[h] = seen
        if len(cur) > self.max_entries:
            self._old, self._cur = cur, {}
        return shared


class _DecayedWork:
    """Per-worker sum of service seconds, halved every ``half_life`` decisions.

    Stored scaled up by a factor that grows each decision, so a decision costs
    O(1), and ``scaled`` values of different workers compare directly.
    """
    __slots__ = ("_gain", "_scale", "scaled")

    def __init__(self, half_life: int):
        self._gain = 2.0 ** (1.0 / half_life)
        self._scale = 1.0
        self.scaled: dict[str, float] = {}

    def get(self, worker_id: str) -> float:
        return self.scaled.get(worker_id, 0.0) / self._scale

    def add(self, worker_id: str, seconds: float) -> None:
        self._scale *= self._gain            # one decision passed: everything decays
        self.scaled[worker_id] = self.scaled.get(worker_id, 0.0) + seconds * self._scale
        if self._scale > 1e150:
            self.scaled = {w: v / self._scale for w, v in self.scaled.items()}
            self._scale = 1.0

    def forget(self, worker_id: str) -> None:
        self.scaled.pop(worker_id, None)


class _InFlight:
    """Blocks this router just sent somewhere, before any KV event can say so.

    A burst of sibling requests (one new document, n samples, parallel tool
    calls) arrives within milliseconds: the index shows none of the new prefix
    yet. Every block of a routed request is remembered with its worker for
    ``ttl_s``; a later request whose chain reaches such a block counts that
    worker as holding the prefix up to it. Two generations bound the memory.
    """
    __slots__ = ("ttl_s", "max_entries", "_cur", "_old")

    def __init__(self, ttl_s: float, max_entries: int = 1 << 16):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._cur: dict[int, tuple[str, float]] = {}
        self._old: dict[int, tuple[str, float]] = {}

    def record(self, hashes: Sequence[int], blocks: int, worker_id: str, now: float) -> None:
        if blocks <= 0:
            return
        entry = (worker_id, now + self.ttl_s)
        self._cur.update(zip(hashes[:blocks], repeat(entry)))
        if len(self._cur) > self.max_entries:
            self._old, self._cur = self._cur, {}

    def deepest(self, hashes: Sequence[int], now: float) -> tuple[int, str | None]:
        """(blocks, worker): the longest prefix of ``hashes`` sent to one worker within the TTL."""
        cur, old = self._cur, self._old
        for i in range(len(hashes) - 1, -1, -1):
            h = hashes[i]
            e = cur.get(h) or old.get(h)
            if e is not None:
                return (i + 1, e[0]) if e[1] >= now else (0, None)
        return 0, None

    def forget(self, worker_id: str) -> None:
        for d in (self._cur, self._old):
            for h in [h for h, e in d.items() if e[0] == worker_id]:
                del d[h]


class _Option:
    """One way to serve the request, priced."""
    __slots__ = ("score", "load", "worker", "reason", "blocks", "ttft", "source", "pulled", "dup")

    def __init__(self, score, load, worker, reason, blocks, ttft, source, pulled, dup):
        self.score, self.load, self.worker, self.reason = score, load, worker, reason
        self.blocks, self.ttft, self.source, self.pulled, self.dup = blocks, ttft, source, pulled, dup


class _Candidates:
    """What ``candidates`` found: per distinct hit, the least loaded worker that
    has it (with its load key), the best holder in the index, and the shared part."""
    __slots__ = ("groups", "source", "source_worker", "inflight_blocks")

    def __init__(self, groups, source, source_worker, inflight_blocks):
        self.groups: dict[PrefixHit, tuple[tuple, WorkerState]] = groups
        self.source: PrefixHit = source
        self.source_worker: WorkerState = source_worker
        self.inflight_blocks: int = inflight_blocks


class CostPolicy(Policy):
    """Cheapest expected TTFT over every option, with the future priced in.

    For each candidate worker (the least loaded holder of each distinct hit,
    and the least loaded worker holding nothing): queue wait + promotion of
    its WARM/COLD hit blocks + prefill of the tokens it lacks. And for each
    candidate that holds less than the best holder: the same worker pulling
    the best holder's extra blocks (reason "migrate"), which the holder first
    stages from its device.

    What an option costs the requests that come after it:

    - ``dup_weight`` x the prefill time of the *private* blocks it copies.
      Pulling or recomputing a conversation's history elsewhere leaves two
      copies: the new one evicts a block on the target, the old one sits dead
      on the holder. Blocks up to the request's last *branch point* (a prefix
      seen continued two ways, e.g. a system prompt) are exempt: a second copy
      of a computed shared prefix is replication that later requests use. A
      prefix still *in flight* (sent within ``inflight_s``, not yet in the
      index) is never exempt: recomputing it elsewhere at the same time is
      pure waste, so sibling requests of a burst follow the first.
    - ``work_weight`` x the option's service time (default 0: the queue wait
      prices load).
    - Placement: options that copy no private block and cost within ``tie_s``
      of the cheapest, or within the mean queue wait of the live workers when
      that is longer, are equal for this request (a difference smaller than
      the queues is changed by the next few arrivals anyway); among them the
      worker this router sent the least work lately (decayed, ``half_life``
      decisions) wins, since a conversation keeps coming back where it is
      placed. At light load this is stickiness; under load, balance.
    """
    name = "cost"

    def __init__(self, cost: CostModel | None = None, options: CostOptions | None = None,
                 clock: Callable[[], float] = time.monotonic, **overrides):
        super().__init__(cost)
        unknown = set(overrides) - set(CostOptions.names())
        if unknown:
            raise InvalidInputError(f"unknown cost policy option(s) {', '.join(sorted(unknown))}; "
                                    f"choose from {', '.join(CostOptions.names())}")
        self.options = replace(options or CostOptions(), **overrides)
        self.clock = clock
        self._branches = _BranchMemory(self.options.branch_memory)
        self._recent = _DecayedWork(self.options.half_life)
        self._inflight = _InFlight(self.options.inflight_s)
        self._ids_of: tuple[list, list[str], dict[str, WorkerState]] | None = None
        self._mean_wait = 0.0     # mean queue wait over live workers at the current decision

    # Old attribute names, kept for callers that read them.
    work_weight = property(lambda self: self.options.work_weight)
    dup_weight = property(lambda self: self.options.dup_weight)
    tie_s = property(lambda self: self.options.tie_s)

    def recent_work_s(self, worker_id: str) -> float:
        """Service seconds this router sent to ``worker_id`` lately (decayed)."""
        return self._recent.get(worker_id)

    def forget_worker(self, worker_id: str) -> None:
        self._recent.forget(worker_id)
        self._inflight.forget(worker_id)
        self._ids_of = None

    # ------------------------------------------------------------ candidates
    def _members(self, alive: list[WorkerState]) -> tuple[list[str], dict[str, WorkerState]]:
        """Ids and id -> state of ``alive``; reused while the caller passes the same list."""
        cached = self._ids_of
        if cached is not None and cached[0] is alive and len(cached[1]) == len(alive):
            return cached[1], cached[2]
        ids = list(map(_ID, alive))
        by_id = dict(zip(ids, alive))
        self._ids_of = (alive, ids, by_id)
        return ids, by_id

    @staticmethod
    def _least(ws: list[WorkerState], recent: dict[str, float]) -> tuple[tuple, WorkerState]:
        """(load key, worker) of the least loaded: fewest queued tokens, then least
        recent work, then list order. Every pass is a builtin over the list (no
        Python-level loop): at 64 workers this is most of a decision."""
        if len(ws) == 1:
            w = ws[0]
            return (w.queued_tokens, recent.get(w.worker_id, 0.0)), w
        qs = list(map(_QUEUED, ws))
        q = min(qs)
        if qs.count(q) > 1:
            ws = list(compress(ws, map(q.__eq__, qs)))
            work = list(map(recent.get, map(_ID, ws), repeat(0.0)))
            r = min(work)
            return (q, r), ws[work.index(r)]
        w = ws[qs.index(q)]
        return (q, recent.get(w.worker_id, 0.0)), w

    def candidates(self, hashes: Sequence[int], workers: Sequence[WorkerState], index: GlobalIndex) -> _Candidates:
        """The options worth pricing: workers with the same hit differ only by
        load, so only the least loaded of each group (and of the workers
        holding nothing) is priced, even when all 64 hold the system prompt."""
        alive = _alive(workers)
        ids, by_id = self._members(alive)
        self._mean_wait = sum(map(_QUEUED, alive)) / (len(alive) * self.cost.prefill_tokens_per_s)
        recent = self._recent.scaled          # one scale for all: compares without unscaling
        cohorts = index.match_cohorts(hashes) if hashes else []
        inflight_blocks, inflight_w = (self._inflight.deepest(hashes, self.clock())
                                       if self.options.inflight_s and hashes else (0, None))
        own = NO_HIT
        if inflight_w is not None:
            if inflight_w in by_id:
                own = next((h for h, wids in cohorts if inflight_w in wids), NO_HIT)
            if inflight_blocks <= own.blocks or inflight_w not in by_id:
                inflight_w, inflight_blocks = None, 0
        groups: dict[PrefixHit, tuple] = {}
        source, source_w = NO_HIT, None
        held: set[str] = set()
        for hit, wids in cohorts:
            members = list(map(by_id.get, wids))
            if None in members:
                members = [m for m in members if m is not None]
            if inflight_w is not None and hit is own and inflight_w in wids:
                members = [m for m in members if m.worker_id != inflight_w]
            held.update(wids)
            if not members:
                continue
            least = self._least(members, recent)
            if hit not in groups or least[0] < groups[hit][0]:   # equal counts, different tier order
                groups[hit] = least
            if (hit.blocks, hit.hot) > (source.blocks, source.hot):
                source, source_w = hit, least[1]
        if inflight_w is not None:
            # The index lags: count the blocks just sent there as HOT on top of what it shows.
            w = by_id[inflight_w]
            hit = PrefixHit(inflight_blocks - own.warm - own.cold, own.warm, own.cold)
            held.add(inflight_w)
            least = ((w.queued_tokens, recent.get(inflight_w, 0.0)), w)
            if hit not in groups or least[0] < groups[hit][0]:
                groups[hit] = least
        rest = alive if not held else list(compress(alive, map(not_, map(held.__contains__, ids))))
        if rest:
            groups[NO_HIT] = self._least(rest, recent)
        if source_w is None:
            source_w = groups[max(groups, key=lambda h: (h.blocks, h.hot))][1]
        return _Candidates(groups, source, source_w, inflight_blocks)

    # --------------------------------------------------------------- pricing
    def price(self, cands: _Candidates, num_tokens: int, shared: int) -> list[_Option]:
        """Every option of every candidate, with its score (TTFT + what it costs later)."""
        cost, opts = self.cost, self.options
        ww = opts.work_weight
        source, source_w = cands.source, cands.source_worker
        source_blocks = source.blocks
        # Copies are priced against the deepest prefix anyone has or is computing;
        # a prefix still in flight is never an exempt shared prefix.
        total_blocks = max(source_blocks, cands.inflight_blocks)
        if cands.inflight_blocks > source_blocks:
            shared = min(shared, source_blocks)
        dup_s = opts.dup_weight * cost.prefill_s(cost.cached_tokens(1, num_tokens))
        out = []
        for h, (load, w) in cands.groups.items():
            blocks = h.hot + h.warm + h.cold
            wait = cost.wait_s(w)
            dup = dup_s * max(0, total_blocks - max(blocks, shared))
            service = cost.service_s(h, num_tokens)
            out.append(_Option(wait + service * (1.0 + ww) + dup, load, w, "local" if blocks else "recompute",
                               blocks, wait + service, None, 0, dup))
            if blocks < source_blocks and w is not source_w:
                service = cost.migrate_service_s(h, source, num_tokens)
                out.append(_Option(wait + service * (1.0 + ww) + dup, load, w, "migrate", source_blocks,
                                   wait + service, source_w.worker_id, source_blocks - blocks, dup))
        return out

    # ---------------------------------------------------------------- choose
    def choose(self, hashes, num_tokens, workers, index, sent=True):
        cost = self.cost
        cands = self.candidates(hashes, workers, index)
        shared = self._branches.observe(hashes, num_tokens // cost.block_tokens)
        self._turn += 1
        options = self.price(cands, num_tokens, shared)
        best = min(options, key=lambda o: (o.score, o.load))
        # Options that copy no private block and cost within tie_s (or the
        # mean queue wait, if longer) of the cheapest are equally good for
        # this request; among them the worker sent the least work lately
        # wins: the conversation will keep coming back there, so this is
        # where its future load is placed.
        limit = best.score + max(self.options.tie_s, self._mean_wait)
        ties = [o for o in options if o.score <= limit and not o.dup]
        if len(ties) > 1:
            best = min(ties, key=lambda o: (o.load[1], o.score, o.load))
        elif ties:
            best = ties[0]
        w = best.worker
        self._recent.add(w.worker_id, best.ttft - cost.wait_s(w))
        if self.options.inflight_s and sent:
            self._inflight.record(hashes, len(hashes), w.worker_id, self.clock())
        return Decision(w.worker_id, best.reason, best.ttft, cost.cached_tokens(best.blocks, num_tokens),
                        best.source, best.pulled)
