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
from functools import partial
from itertools import compress, repeat
from operator import attrgetter, ne
from typing import Callable, NamedTuple, Sequence

from cluster.errors import InvalidInputError
from cluster.routing.index import NO_HIT, GlobalIndex, PrefixHit
from cluster.protocol import RouteDecision
from cluster.routing.policies.base import CostModel, Policy, WorkerState, _alive

_QUEUED = attrgetter("queued_tokens")
_ID = attrgetter("worker_id")
_SCORE_LOAD = attrgetter("score", "load")


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
    - ``replicate_share``: copy a hot shared prefix to a lightly loaded worker
      when the holder chosen for it got more than this multiple of the mean
      recent work (0: off; see ``CostPolicy``).
    - ``replicate_budget_s``: the most TTFT the replicating request may lose
      against serving on the holder.
    """
    work_weight: float = 0.0
    dup_weight: float = 3.0
    tie_s: float = 0.05
    half_life: int = 2000
    branch_memory: int = 1 << 20
    inflight_s: float = 1.0
    replicate_share: float = 1.5
    replicate_budget_s: float = 0.1

    def __post_init__(self) -> None:
        for name in ("work_weight", "dup_weight", "tie_s", "inflight_s", "replicate_share", "replicate_budget_s"):
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
        k = min(len(hashes), full_blocks) - 1
        if k <= 0:
            return 0
        heads, nexts = hashes[:k], hashes[1:k + 1]
        seen = list(map(cur.get, heads))
        if seen == nexts:      # a path walked before, no branch on it: nothing to learn
            return 0
        if len(set(heads)) != k:
            return self._observe_each(heads, nexts)
        # Only the blocks whose successor is not the one remembered need work
        # (chain hashes are distinct, so the order of the updates does not matter).
        shared = 0
        for i in compress(range(k), map(ne, seen, nexts)):
            h, s = heads[i], seen[i]
            if s is None:
                s = old.get(h)
                if s is None or s == nexts[i]:
                    cur[h] = nexts[i]    # a new block, or one remembered from the older generation
                    continue
            cur[h] = branch              # continued two ways (or known as a branch point)
            shared = i + 1
        if len(cur) > self.max_entries:
            self._old, self._cur = cur, {}
        return shared

    def _observe_each(self, heads: Sequence[int], nexts: Sequence[int]) -> int:
        """``observe`` one block at a time, for a chain that repeats a hash."""
        cur, old, branch = self._cur, self._old, self.BRANCH
        shared = 0
        for i, (h, nxt) in enumerate(zip(heads, nexts)):
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
    O(1), and ``scaled`` values of different workers compare directly;
    ``total`` is their sum, kept as they change.
    """
    __slots__ = ("_gain", "_scale", "scaled", "total")

    def __init__(self, half_life: int):
        self._gain = 2.0 ** (1.0 / half_life)
        self._scale = 1.0
        self.scaled: dict[str, float] = {}
        self.total = 0.0

    def get(self, worker_id: str) -> float:
        return self.scaled.get(worker_id, 0.0) / self._scale

    def add(self, worker_id: str, seconds: float) -> None:
        self._scale *= self._gain            # one decision passed: everything decays
        added = seconds * self._scale
        self.scaled[worker_id] = self.scaled.get(worker_id, 0.0) + added
        self.total += added
        if self._scale > 1e150:
            self.scaled = {w: v / self._scale for w, v in self.scaled.items()}
            self.total = sum(self.scaled.values())
            self._scale = 1.0

    def forget(self, worker_id: str) -> None:
        self.total -= self.scaled.pop(worker_id, 0.0)


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


class _Option(NamedTuple):
    """One way to serve the request, priced (a tuple: a decision builds several)."""
    score: float
    load: tuple
    worker: WorkerState
    reason: str
    blocks: int
    ttft: float
    source: str | None
    pulled: int
    dup: float


_new_option = partial(tuple.__new__, _Option)   # without NamedTuple's Python-level __new__


class _Candidates:
    """What ``candidates`` found: per distinct hit, the least loaded worker that
    has it (with its load key), the best holder in the index, and the shared part."""
    __slots__ = ("groups", "source", "source_worker", "inflight_blocks", "rest")

    def __init__(self, groups, source, source_worker, inflight_blocks, rest=None):
        self.groups: dict[PrefixHit, tuple[tuple, WorkerState]] = groups
        self.source: PrefixHit = source
        self.source_worker: WorkerState = source_worker
        self.inflight_blocks: int = inflight_blocks
        # The workers holding nothing, (states, ids), when their least loaded one
        # is found only if it can matter (see ``price``); else it is in ``groups``.
        self.rest: tuple[list[WorkerState], list[str]] | None = rest


class _Membership:
    """The live workers of one decision's list: by id, by index bit, and the
    members of each holder mask the index answers with (cached: the same
    holder sets come back on every request sharing a prefix). The lists hold
    the caller's ``WorkerState`` objects, so they see its load updates."""
    __slots__ = ("alive", "index", "version", "ids", "by_id", "alive_mask", "unindexed", "_by_mask")
    MAX_MASKS = 4096

    def __init__(self, alive: list[WorkerState], index: GlobalIndex):
        self.alive, self.index, self.version = alive, index, index.version
        self.ids = list(map(_ID, alive))
        self.by_id = dict(zip(self.ids, alive))
        self.alive_mask = 0
        self.unindexed = []   # alive but unknown to the index: they hold nothing
        for w in alive:
            bit = index.bit_of(w.worker_id)
            if bit is None:
                self.unindexed.append(w)
            else:
                self.alive_mask |= bit
        self._by_mask: dict[int, tuple[list[WorkerState], list[str]]] = {}

    def members_of(self, mask: int) -> tuple[list[WorkerState], list[str]]:
        """The alive workers of a holder mask, and their ids (do not mutate)."""
        members = self._by_mask.get(mask)
        if members is None:
            by_id = self.by_id
            ids = list(filter(by_id.__contains__, self.index.workers_of(mask)))
            members = (list(map(by_id.__getitem__, ids)), ids)
            if len(self._by_mask) >= self.MAX_MASKS:
                self._by_mask.clear()
            self._by_mask[mask] = members
        return members


class CostPolicy(Policy):
    """Cheapest expected TTFT over every option, with the future priced in.

    For each candidate worker (the least loaded holder of each distinct hit,
    and the least loaded worker holding nothing): queue wait + promotion of
    its WARM/COLD hit blocks + prefill of the tokens it lacks. And for each
    candidate that holds less than the best holder: the same worker pulling
    the best holder's extra blocks (reason "migrate"), which the holder first
    stages from its device. And for each candidate that holds less than L3
    (the cluster-wide store), where reading a block from L3 beats computing
    it: the worker fetching the blocks it lacks from L3 (reason "l3"). Only
    L3 may hold a crashed or departed replica's prefixes: then "l3" is the
    option that saves the prefill.

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
    - Replication (``replicate_share``; 0 turns it off): at light load no
      queue forms, so the pricing above keeps every request of a hot shared
      prefix (a long system prompt, a tool catalogue) on its holders however
      much of the traffic that prefix carries. When the holder chosen for a
      request whose hit is mostly shared prefix got more than
      ``replicate_share`` x the mean recent work, and the prefix is in the
      index (not still in flight), the request instead pulls the prefix to
      the least loaded worker that got less than the mean (reason
      "replicate"), if that costs it at most ``replicate_budget_s`` more:
      one request pays the pull, and the prefix's later requests have one
      more holder to spread over.
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
        self._members_cache: _Membership | None = None
        self._mean_wait = 0.0     # mean queue wait over live workers at the current decision

    def recent_work_s(self, worker_id: str) -> float:
        """Service seconds this router sent to ``worker_id`` lately (decayed)."""
        return self._recent.get(worker_id)

    def forget_worker(self, worker_id: str) -> None:
        self._recent.forget(worker_id)
        self._inflight.forget(worker_id)
        self._members_cache = None

    # ------------------------------------------------------------ candidates
    def _membership(self, alive: list[WorkerState], index: GlobalIndex) -> "_Membership":
        """Who is alive, by id and by index bit; reused while the caller passes the
        same list and the index has not reassigned bits."""
        mem = self._members_cache
        if (mem is not None and mem.alive is alive and len(mem.ids) == len(alive)
                and mem.index is index and mem.version == index.version):
            return mem
        self._members_cache = mem = _Membership(alive, index)
        return mem

    def _least(self, ws: list[WorkerState], ids: list[str], recent: dict[str, float]) -> tuple[tuple, WorkerState]:
        """(load key, worker) of the least loaded: fewest queued tokens, then least
        recent work, then list order from this router's ``tie_salt`` on. Every
        pass is a builtin over the list (no Python-level loop): at 64 workers
        this is most of a decision."""
        if len(ws) == 1:
            w = ws[0]
            return (w.queued_tokens, recent.get(w.worker_id, 0.0)), w
        qs = list(map(_QUEUED, ws))
        q = min(qs)
        tied = qs.count(q)
        if tied == 1:
            w = ws[qs.index(q)]
            return (q, recent.get(w.worker_id, 0.0)), w
        if tied < len(ws):
            keep = list(map(q.__eq__, qs))
            ws, ids = list(compress(ws, keep)), list(compress(ids, keep))
        work = list(map(recent.get, ids, repeat(0.0)))
        r = min(work)
        at = work.index(r)
        if self.tie_salt and work.count(r) > 1:
            start = self.tie_salt % len(work)
            if start > at:
                try:
                    at = work.index(r, start)
                except ValueError:   # no tie at or after this router's place: the first
                    pass
        return (q, r), ws[at]

    def candidates(self, hashes: Sequence[int], workers: Sequence[WorkerState], index: GlobalIndex) -> _Candidates:
        """The options worth pricing: workers with the same hit differ only by
        load, so only the least loaded of each group (and of the workers
        holding nothing) is priced, even when all 64 hold the system prompt."""
        alive = _alive(workers)
        mem = self._membership(alive, index)
        by_id, members_of = mem.by_id, mem.members_of
        self._mean_wait = sum(map(_QUEUED, alive)) / (len(alive) * self.cost.prefill_tokens_per_s)
        recent = self._recent.scaled          # one scale for all: compares without unscaling
        cohorts = index.match_masks(hashes) if hashes else []
        inflight_blocks, inflight_w = (self._inflight.deepest(hashes, self.clock())
                                       if self.options.inflight_s and hashes else (0, None))
        own, inflight_bit = NO_HIT, 0
        if inflight_w is not None:
            if inflight_w in by_id:
                inflight_bit = index.bit_of(inflight_w) or 0
                own = next((h for h, mask in cohorts if mask & inflight_bit), NO_HIT)
            if inflight_blocks <= own.blocks or inflight_w not in by_id:
                inflight_w, inflight_blocks, inflight_bit = None, 0, 0
        groups: dict[PrefixHit, tuple] = {}
        source, source_w = NO_HIT, None
        held = 0
        for hit, mask in cohorts:
            held |= mask
            if inflight_bit and hit is own and mask & inflight_bit:
                mask ^= inflight_bit        # priced below, with what it is computing
            members, member_ids = members_of(mask)
            if not members:
                continue
            least = self._least(members, member_ids, recent)
            if hit not in groups or least[0] < groups[hit][0]:   # equal counts, different tier order
                groups[hit] = least
            if (hit[0] + hit[1] + hit[2], hit[0]) > (source[0] + source[1] + source[2], source[0]):
                source, source_w = hit, least[1]
        if inflight_w is not None:
            # The index lags: count the blocks just sent there as HOT on top of what it shows.
            w = by_id[inflight_w]
            hit = PrefixHit(inflight_blocks - own.warm - own.cold, own.warm, own.cold)
            held |= inflight_bit
            least = ((w.queued_tokens, recent.get(inflight_w, 0.0)), w)
            if hit not in groups or least[0] < groups[hit][0]:
                groups[hit] = least
        if not held and inflight_w is None:
            rest, rest_ids = alive, mem.ids
        else:
            rest, rest_ids = members_of(mem.alive_mask & ~held)
            if mem.unindexed:   # alive, unknown to the index (holding nothing), not the in-flight one
                extra = [w for w in mem.unindexed if w.worker_id != inflight_w]
                rest, rest_ids = rest + extra, rest_ids + list(map(_ID, extra))
        if rest and not groups:
            groups[NO_HIT] = self._least(rest, rest_ids, recent)
        if source_w is None:
            source_w = groups[max(groups, key=lambda h: (h.blocks, h.hot))][1]
        return _Candidates(groups, source, source_w, inflight_blocks,
                           (rest, rest_ids) if rest and NO_HIT not in groups else None)

    # --------------------------------------------------------------- pricing
    def price(self, cands: _Candidates, num_tokens: int, shared: int, *, idle_only: bool = False,
              l3_blocks: int = 0) -> list[_Option]:
        """Every option of every candidate, with its score (TTFT + what it costs later).
        ``idle_only``: only the options of the least loaded worker holding
        nothing, priced even where they cannot be cheapest (a replication target
        that the first pricing left out)."""
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
        wait_s, service_s, migrate_s = cost.wait_s, cost.service_s, cost.migrate_service_s
        l3_s = cost.l3_service_s if l3_blocks and cost.l3_pays else None
        gain = 1.0 + ww
        source_id = source_w.worker_id
        out = []
        append = out.append

        def options_of(h: PrefixHit, load: tuple, w: WorkerState) -> None:
            blocks = h[0] + h[1] + h[2]
            wait = wait_s(w)
            dup = dup_s * (total_blocks - blocks if blocks > shared else total_blocks - shared) if (
                total_blocks > blocks and total_blocks > shared) else 0.0
            service = service_s(h, num_tokens)
            append(_new_option((wait + service * gain + dup, load, w, "local" if blocks else "recompute",
                                blocks, wait + service, None, 0, dup)))
            if blocks < source_blocks and w is not source_w:
                service = migrate_s(h, source, num_tokens)
                append(_new_option((wait + service * gain + dup, load, w, "migrate", source_blocks,
                                    wait + service, source_id, source_blocks - blocks, dup)))
            if l3_s is not None and blocks < l3_blocks:
                service = l3_s(h, l3_blocks, num_tokens)
                append(_new_option((wait + service * gain + dup, load, w, "l3", l3_blocks,
                                    wait + service, None, l3_blocks - blocks, dup)))

        if not idle_only:
            for h, (load, w) in cands.groups.items():
                options_of(h, load, w)
        if cands.rest is not None:
            # A worker holding nothing is worth finding only if one of its options
            # could be cheapest or tie (``choose``) even with an empty queue.
            dup = dup_s * (total_blocks - shared) if total_blocks > shared else 0.0
            bound = service_s(NO_HIT, num_tokens) * gain + dup
            if source_blocks:
                bound = min(bound, migrate_s(NO_HIT, source, num_tokens) * gain + dup)
            if l3_s is not None:
                bound = min(bound, l3_s(NO_HIT, l3_blocks, num_tokens) * gain + dup)
            if idle_only or bound <= min(o.score for o in out) + max(opts.tie_s, self._mean_wait):
                load, w = self._least(*cands.rest, self._recent.scaled)
                options_of(NO_HIT, load, w)
        return out

    def _replica(self, best: _Option, options: list[_Option], cands: _Candidates, num_tokens: int,
                 shared: int, l3_blocks: int = 0) -> _Option:
        """``best``, or pulling its prefix to a lightly loaded worker when ``best``'s
        holder got more than ``replicate_share`` x the mean recent work."""
        recent = self._recent.scaled          # one scale for all workers: compares directly
        # Over the live workers; a dead one's work stays counted until it is dropped (forget_worker).
        mean = self._recent.total / len(self._members_cache.alive)
        if recent.get(best.worker.worker_id, 0.0) <= self.options.replicate_share * mean:
            return best
        limit = best.ttft + self.options.replicate_budget_s

        def targets(opts: list[_Option]) -> list[_Option]:
            return [o for o in opts if o.reason == "migrate" and o.ttft <= limit
                    and recent.get(o.worker.worker_id, 0.0) < mean]

        found = targets(options)
        if not found and cands.rest is not None:   # the idle workers were not priced: price them now
            found = targets(self.price(cands, num_tokens, shared, idle_only=True, l3_blocks=l3_blocks))
        if not found:
            return best
        return min(found, key=_SCORE_LOAD)._replace(reason="replicate")

    # ---------------------------------------------------------------- choose
    def choose(self, hashes, num_tokens, workers, index, sent=True):
        cost = self.cost
        cands = self.candidates(hashes, workers, index)
        shared = self._branches.observe(hashes, num_tokens // cost.block_tokens)
        self._turn += 1
        l3_blocks = index.l3_blocks(hashes) if cost.l3_pays and hashes and index.num_l3 else 0
        options = self.price(cands, num_tokens, shared, l3_blocks=l3_blocks)
        best = min(options, key=_SCORE_LOAD)
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
        if (self.options.replicate_share and best.reason == "local" and shared * 2 >= best.blocks > 0
                and cands.inflight_blocks <= cands.source.blocks):
            best = self._replica(best, options, cands, num_tokens, shared, l3_blocks)
        w = best.worker
        self._recent.add(w.worker_id, best.ttft - cost.wait_s(w))
        if self.options.inflight_s and sent:
            self._inflight.record(hashes, len(hashes), w.worker_id, self.clock())
        if best.reason == "l3":
            return RouteDecision(w.worker_id, "l3", best.ttft, cost.cached_tokens(best.blocks, num_tokens),
                                 l3_blocks=best.pulled)
        return RouteDecision(w.worker_id, best.reason, best.ttft, cost.cached_tokens(best.blocks, num_tokens),
                        best.source, best.pulled)
