"""Calibration: a worker's ``CostModel``, measured through the paths requests take.

- prefill: ``Engine.generate`` of fresh random prompts (match, admit, packed
  forward, KV store, insert), tokens per second of prompt;
- WARM promotion: a cached prefix demoted to the host tier, then brought
  back by ``TieredCache.match`` (the copy engine a request waits on);
- COLD promotion: the same from the disk tier, after dropping the file's
  pages from the OS cache, so the read measures the device and the checksum;
- transfer: a NIXL READ by this worker's own endpoint into its staging
  blocks, with every block verified (``Migrator.pull_blocks_nixl``), from a
  scratch agent holding blocks of the same size.
- L3 fetch: blocks of this worker's KV shape written to L3 under keys no
  request uses, then read back with verification (``L3Store.get_blocks``,
  what a fetch does), tokens per second; none when L3 is off.

It runs at start-up only where ``calibrate_at_start`` asks (before the engine thread owns
the cache; it leaves the cache empty and its counters as they were). By default a worker
serves at once on a peer's rates or on ``prior_rates`` (one prefill), and ``RateRefiner``
replaces them with what the engine and the cache measure on real requests. Missing tiers or NIXL fall back to ratios of what was
measured (transfer = WARM/4, COLD = WARM/10) so the model is complete.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

import torch

from actors.migration import Migrator, block_checksum
from cluster.cache.l3 import L3Block, L3Lookup
from cluster.cache.l3.tier import L3Tier
from cluster.cache.tiered import TieredCache
from cluster.engine.engine import Engine, SamplingParams
from cluster.names import COLD, WARM
from cluster.routing.policies import CostModel
from cluster.transfer.nixl_transport import NixlEndpoint, recommended_ucx_env

log = logging.getLogger(__name__)


def calibrate(engine: Engine, migrator: Migrator, *, repeats: int = 2, seed: int = 0) -> CostModel:
    cache = engine.cache
    bt = cache.config.block_tokens
    cfg = engine.model.config
    n = max(bt, min(256, cache.config.hot_blocks * bt // 4, cfg.max_position - 2) // bt * bt)
    gen = torch.Generator().manual_seed(seed)

    def fresh_prompt() -> list[int]:
        return torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()

    counters = [(d, dict(d)) for d in (engine.stats, cache.stats, cache.tree.stats)]
    # Random calibration prompts are no one's prefixes: nothing of them goes to L3.
    l3, cache.l3 = cache.l3, None
    try:
        prefill = _best(lambda: _timed(lambda: engine.generate(fresh_prompt(), SamplingParams(max_tokens=1)), n),
                        repeats)
        warm = _best(lambda: _promotion(engine, fresh_prompt(), WARM), repeats) if cache.num_tiers > WARM else None
        cold = _best(lambda: _promotion(engine, fresh_prompt(), COLD), repeats) if cache.num_tiers > COLD else None
        transfer = _nixl_rate(migrator, cache) if migrator.nixl is not None else None
        l3_rate = _l3_rate(cache, l3.tier, gen) if l3 is not None else None
    finally:
        cache.l3 = l3
        cache.drop_all()
        for live, before in counters:   # the worker's counters start at zero for its requests
            live.clear()
            live.update(before)
    return completed_rates(bt, prefill, warm, cold, transfer, l3_rate)


def completed_rates(block_tokens: int, prefill: float, warm: float | None = None, cold: float | None = None,
                    transfer: float | None = None, l3_fetch: float | None = None) -> CostModel:
    """A complete ``CostModel`` from the rates measured (tokens per second each; None: not
    measured): a missing WARM rate is 20x prefill, COLD WARM/10, transfer WARM/4, no L3 0."""
    warm = warm or prefill * 20
    return CostModel(prefill_tokens_per_s=prefill, warm_promote_tokens_per_s=warm,
                     cold_promote_tokens_per_s=cold or warm / 10, transfer_tokens_per_s=transfer or warm / 4,
                     block_tokens=block_tokens, l3_fetch_tokens_per_s=l3_fetch or 0.0)


def _timed(fn: Callable[[], object], tokens: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    fn()
    return tokens, time.perf_counter() - t0


def _best(op: Callable[[], tuple[int, float] | None], repeats: int) -> float | None:
    """One warm-up, then the best rate (tokens/s) of ``repeats`` runs."""
    op()
    best = None
    for _ in range(repeats):
        got = op()
        if got is None or got[1] <= 0 or got[0] <= 0:
            continue
        rate = got[0] / got[1]
        best = rate if best is None else max(best, rate)
    return best


def _promotion(engine: Engine, prompt: list[int], tier: int) -> tuple[int, float] | None:
    cache = engine.cache
    engine.generate(prompt, SamplingParams(max_tokens=1))
    if cache.demote_path(prompt, None, tier) == 0:
        return None
    if tier == COLD:
        cache.drop_page_cache()
    t0 = time.perf_counter()
    lease = cache.admit(prompt, compute_last=False)
    dt = time.perf_counter() - t0
    lease.release()
    return (lease.promoted_tokens, dt) if lease.promoted_tokens else None


def _l3_rate(cache: TieredCache, tier: L3Tier, gen: torch.Generator, nblocks: int = 8) -> float | None:
    """Write ``nblocks`` blocks of random KV to L3 under hashes no request has
    (random 64-bit values), read them back verified: tokens per second."""
    if tier.store.stats().state != "on":
        return None
    lay, bt = cache.layout, tier.block_tokens
    blocks = []
    for _ in range(nblocks):
        h = int(torch.randint(0, 1 << 62, (1,), generator=gen)) | (1 << 62)
        kv = torch.randn(lay.num_layers, 2, bt, lay.num_kv_heads, lay.head_dim, generator=gen).to(cache.kv_dtype)
        blocks.append(L3Block(tier.key(h), tuple(range(bt)), kv))
    if not all(r.stored for r in tier.store.put_blocks(blocks)):
        log.warning("could not write calibration blocks to L3; L3 fetches are not priced")
        return None
    lookups = [L3Lookup(b.key, b.tokens) for b in blocks]

    def read() -> tuple[int, float] | None:
        t0 = time.perf_counter()
        got = tier.store.get_blocks(lookups)
        dt = time.perf_counter() - t0
        return (nblocks * bt, dt) if all(r.hit for r in got) else None
    return _best(read, 2)


def _nixl_rate(migrator: Migrator, cache: TieredCache, nblocks: int = 8) -> float | None:
    """READ ``nblocks`` host blocks from a scratch agent into our staging
    blocks, verified: tokens per second of the real pull path."""
    host = cache.staging.tensor
    nblocks = min(nblocks, host.shape[0] // 4)
    if nblocks < 1:
        return None
    src = torch.randn((nblocks, *host.shape[1:])).to(host.dtype)
    try:
        with NixlEndpoint(f"probe-{migrator.worker_id}-{id(src):x}", src, ucx_env=recommended_ucx_env()) as scratch:
            peer = migrator.nixl.connect(scratch.metadata())
            blocks, tokens = list(range(nblocks)), nblocks * migrator.block_tokens
            checksums = [block_checksum(b) for b in src]
            return _best(lambda: _timed(lambda: migrator.pull_blocks_nixl(peer, blocks, checksums, tokens),
                                        tokens), 2)
    except Exception as exc:  # measuring must never stop a worker from starting
        log.warning("could not measure the NIXL transfer rate: %s", exc)
        return None


def prior_rates(engine: Engine, *, seed: int = 0) -> CostModel:
    """What a worker serves on until it has measured its own rates (no peer's to take): the
    second of two prefills of four blocks of random tokens (the first is the model's warm-up:
    its first forward on a replica that starts beside Ray's own start-up took 2.5 s for 64
    tokens on a 2-core VM, a tenth of the rate, and the autoscaler reads queued prompt tokens
    at this rate until the engine has measured its own), and the copy rates as the ratios
    ``calibrate`` falls back on. Runs before the engine thread owns the cache; leaves it empty."""
    cache = engine.cache
    bt = cache.config.block_tokens
    cfg = engine.model.config
    n = max(1, min(4 * bt, cache.config.hot_blocks * bt // 4, cfg.max_position - 2))
    gen = torch.Generator().manual_seed(seed)
    counters = [(d, dict(d)) for d in (engine.stats, cache.stats, cache.tree.stats)]
    l3, cache.l3 = cache.l3, None
    try:
        for _ in range(2):   # distinct prompts: the second shares no prefix with the first
            prompt = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
            tokens, seconds = _timed(lambda p=prompt: engine.generate(p, SamplingParams(max_tokens=1)), n)
        # One WARM promotion of it (about a millisecond), so the cache's WARM copy rate is
        # measured before serving, as calibration leaves it: inline promotions and
        # promote-or-recompute read it.
        if cache.num_tiers > WARM and cache.demote_path(prompt, None, WARM):
            cache.admit(prompt, compute_last=False).release()
    finally:
        cache.l3 = l3
        cache.drop_all()
        for live, before in counters:
            live.clear()
            live.update(before)
    return completed_rates(bt, tokens / max(seconds, 1e-6))


class RateRefiner:
    """The worker's rates while it serves: the start-up ones (a peer's or the prior) replaced
    by what the engine and the cache measure on real requests (the engine's prefill steps,
    the cache's promotions, NIXL pulls, L3 fetches: each a median of recent samples or a
    smoothed rate). ``tick`` on the engine thread after every iteration; a rate that moved
    by more than ``min_change`` (relative) from the one in force replaces it, and
    ``on_change(cost)`` re-registers the worker (the directory re-prices on a real change).
    ``measured``: the rates this worker has measured itself so far."""

    def __init__(self, cost: CostModel, sources: dict[str, Callable[[], float | None]],
                 on_change: Callable[[CostModel], None], min_change: float = 0.25):
        self.cost = cost
        self.sources = sources
        self.on_change = on_change
        self.min_change = min_change
        self.measured: set[str] = set()
        self.changes = 0

    def tick(self) -> bool:
        changed = {}
        for name, read in self.sources.items():
            value = read()
            if not value or value <= 0:
                continue
            self.measured.add(name)
            old = getattr(self.cost, name)
            if not old or abs(value / old - 1.0) > self.min_change:
                changed[name] = float(value)
        if not changed:
            return False
        self.cost = dataclasses.replace(self.cost, **changed)
        self.changes += 1
        self.on_change(self.cost)
        return True

    def latest(self) -> dict[str, float]:
        """The latest measure of each rate this worker has measured itself (by name)."""
        out = {}
        for name in sorted(self.measured):
            value = self.sources[name]()
            if value and value > 0:
                out[name] = float(value)
        return out


def rate_sources(engine: Engine, migrator: Migrator, l3: L3Tier | None) -> dict[str, Callable[[], float | None]]:
    """Where each rate is measured while serving (engine thread reads)."""
    moves = engine.cache.moves

    def per_token(tier: int) -> Callable[[], float | None]:
        return lambda: 1.0 / moves.promote_s_per_token[tier] if moves.promote_s_per_token[tier] else None
    sources = {"prefill_tokens_per_s": lambda: engine.prefill_tokens_per_s,
               "warm_promote_tokens_per_s": per_token(WARM), "cold_promote_tokens_per_s": per_token(COLD)}
    if migrator.nixl is not None:
        sources["transfer_tokens_per_s"] = lambda: migrator.transfer_tokens_per_s
    if l3 is not None:
        sources["l3_fetch_tokens_per_s"] = lambda: l3.fetch_tokens_per_s
    return sources
