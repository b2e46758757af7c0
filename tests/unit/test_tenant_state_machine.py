"""Tenants under quotas, driven at random: every accepted request is served, caps and
active tenants' guarantees hold.

A Hypothesis state machine drives one engine with ``tenant_quotas`` over HOT,
WARM and COLD (a disk directory), under one of a few hand-made quota
configurations, some with ``default`` guarantees that add up past HOT once
several unlisted tenants (``U1``, ``U2`` and the shared namespace ``None``) have
work, or under any configuration the config check accepts (``quota_configs``:
guarantees and caps of any tier down to a share smaller than a block, whole-tier
guarantees, a step budget of one token, a short activity window). Rules submit
requests of five tenants (a new prompt, or a tenant's next turn on its last
sequence), step the engine, and cancel requests. A request is refused at submit
exactly when its prompt and ``max_tokens`` pass its tenant's HOT cap (less a
block of slack); everything else must be served. After every step:

- no accepted request waits more than ``IDLE_STEPS`` steps in a row on an
  otherwise idle engine (a step that computed nothing, with nothing running and
  no tier move in flight after it);
- no tenant holds more of HOT than its cap (its running requests' KV counted);
- a tenant with a running request, or a waiting one while the engine is not
  lending the waiting tenants' guarantees (``cluster.engine.tenant_work``: only on
  an otherwise idle engine whose last step planned nothing), never loses a prefix
  to another tenant while at or under its guarantee: checked at every pick of a
  node to push down, against the queues as the test saw them before the step;
- a tenant with waiting work and no running request, while every running slot is
  taken and another tenant holds more than its share of them, runs a request at the
  next step (``cluster.engine.policies.fair``: the slot it is owed is kept for it);
- the cache's invariants hold (every committed node whole in its tier, each
  tenant's counts as the tree holds them), and nothing left the tree while the
  tier below had room for it;
- L3 is on for writes (an in-process store, its I/O run after each step), with
  ``l3_blocks`` and per-tenant L3 shares: no tenant's blocks in the store pass its
  L3 cap, all of them together never pass ``l3_blocks``, and the quotas count
  exactly what the store holds. (Fetches are off: a request waiting for one
  plans nothing, which the idle-step rules above do not model.)
"""

from __future__ import annotations

import tempfile
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cluster.cache.kv_pool import KVLayout
from cluster.cache.l3.memory import MemoryL3Store
from cluster.cache.l3.tier import L3Tier, L3TierConfig
from cluster.cache.quotas import NOBODY
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.engine.engine import Engine, EngineRequest, SamplingParams
from cluster.errors import InvalidInputError
from cluster.names import HOT
from cluster.protocol import FinishReason
from tests.unit.test_pressure_state_machine import BT, MODEL

TENANTS = ("A", "B", "U1", "U2", None)   # A and B listed (in some configurations), the rest ``default``
IDLE_STEPS = 4
L3_INDEX = 3
SLOT_STEPS = 1   # the tenant most over its share yields a slot at the next step
CONFIGS = (
    # default guarantees that add up past HOT with three unlisted tenants at work
    {"l3_blocks": 8, "default": {"hot": {"guarantee": 0.25}, "l3": {"cap": 0.5}},
     "tenants": {"A": {"hot": {"guarantee": 0.5}}}},
    # caps: B's leaves room for short requests only; default's refuses the longest
    {"l3_blocks": 10, "default": {"hot": {"guarantee": 0.2, "cap": 0.5}, "warm": {"cap": 0.5}},
     "tenants": {"A": {"hot": {"guarantee": 0.4, "cap": 0.8}, "warm": {"guarantee": 0.5},
                       "l3": {"guarantee": 0.5, "cap": 0.7}},
                 "B": {"hot": {"cap": 0.3}, "l3": {"cap": 0.2}}}},
    # WARM and COLD shares too
    {"l3_blocks": 6, "default": {"hot": {"guarantee": 0.3}, "cold": {"cap": 0.5}},
     "tenants": {"B": {"hot": {"guarantee": 0.4}, "warm": {"guarantee": 0.3, "cap": 0.6}}}},
)


SHARES = (0.0, 0.01, 0.1, 0.25, 0.4, 0.5, 0.75, 1.0)


@st.composite
def tier_share(draw) -> dict:
    cap = draw(st.sampled_from(SHARES[1:]))
    out = {}
    if draw(st.booleans()):
        out["cap"] = cap
    if draw(st.booleans()):
        out["guarantee"] = draw(st.sampled_from([g for g in SHARES if g <= cap]))
    return out


@st.composite
def tenant_quota(draw, l3: bool) -> dict:
    tiers = ("hot", "warm", "cold", "l3") if l3 else ("hot", "warm", "cold")
    return {tier: draw(tier_share()) for tier in tiers if draw(st.booleans())}


@st.composite
def quota_configs(draw) -> dict:
    """Any ``tenant_quotas`` the config check accepts, over the machine's tenants (A and B
    listed or not, the rest ``default``)."""
    from cluster.cache.quota_config import QuotaConfig

    l3_blocks = draw(st.sampled_from([0, 0, 1, 4, 12]))
    config: dict = {"l3_blocks": l3_blocks, "default": draw(tenant_quota(l3_blocks > 0)),
                    "tenants": {t: draw(tenant_quota(l3_blocks > 0)) for t in ("A", "B") if draw(st.booleans())}}
    if draw(st.booleans()):
        config["step_tokens"] = draw(st.sampled_from([1, 3, 8, 32]))
    if draw(st.booleans()):
        config["active_window_s"] = draw(st.sampled_from([0.5, 2.0, 30.0]))
    entries = [config["default"], *config["tenants"].values()]
    for tier in ("hot", "warm", "cold", "l3"):   # guarantees that add up past the tier: the last ones dropped
        while sum(e.get(tier, {}).get("guarantee", 0.0) for e in entries) > 1.0:
            next(e for e in reversed(entries) if e.get(tier, {}).get("guarantee", 0.0))[tier].pop("guarantee")
    QuotaConfig.parse(config)   # accepted
    return config


class TenantMachine(RuleBasedStateMachine):
    @initialize(config=st.one_of(st.sampled_from(CONFIGS), quota_configs()), time_slice=st.booleans())
    def build(self, config, time_slice):
        c = MODEL.config
        self.dir = tempfile.TemporaryDirectory()
        cache = TieredCache(TierConfig(hot_blocks=24, warm_blocks=24, cold_blocks=32, block_tokens=BT,
                                       disk_dir=self.dir.name, device="cpu", tenant_quotas=config),
                            KVLayout(c.num_layers, c.num_kv_heads, c.head_dim), vocab_size=c.vocab_size,
                            deterministic_io=True)
        self.now = 0.0
        self.store = MemoryL3Store()
        self.l3 = L3Tier(self.store, cache.layout, BT, L3TierConfig(model_id="tenant-sm", fetch="off"),
                         start_thread=False)
        self.l3_tenant: dict[int, object] = {}   # block hash -> the tenant it was written for

        machine = self

        class Heard:
            def on_l3_stored(self, hashes, namespace=None):
                machine.l3_tenant.update((h, namespace) for h in hashes)

            def on_l3_removed(self, hashes):
                pass

            def on_l3_inventory(self, hashes):
                pass
        self.l3.listeners.append(Heard())
        cache.attach_l3(self.l3)
        self.engine = Engine(MODEL, cache, max_batch_tokens=16, max_running=4, cache_final_token=False,
                             time_slice_s=3.0 if time_slice else None, clock=lambda: self.now)
        self.quotas = cache.quotas
        self.requests: list[EngineRequest] = []
        self.last: dict = {}   # tenant -> its last finished request
        self.idle_steps = 0
        self.slotless: dict = {}   # tenant -> steps in a row it had waiting work and no running request
        self.kept_from: tuple[set, set, bool] | None = None   # the step's running, waiting tenants; lending
        pick = self.quotas.pick

        def checked_pick(tier, *, leaves_only):
            node = pick(tier, leaves_only=leaves_only)
            if node is not None and self.kept_from is not None:
                self._check_guarantee(node, tier)
            return node
        self.quotas.pick = checked_pick   # the tier space asks the quotas for every pick

    def _check_guarantee(self, node, tier: int) -> None:
        who = self.quotas.actor[0]
        victim = self.engine.cache.tree.namespace_of(node)
        if who is NOBODY or who == victim:
            return
        running, waiting, lending = self.kept_from
        kept = victim in running or (victim in waiting and not lending)
        if kept:
            assert self.quotas.holds(victim, tier) > self.quotas.guarantee(victim, tier), (
                f"tenant {victim!r} (at work) lost a node of tier {tier} to {who!r} while within its guarantee")

    # ------------------------------------------------------------------ rules
    @rule(tenant=st.sampled_from(TENANTS), length=st.integers(2, 40), max_tokens=st.integers(1, 6),
          first=st.integers(0, 63), next_turn=st.booleans(), extra=st.integers(1, 12))
    def submit(self, tenant, length, max_tokens, first, next_turn, extra):
        prev = self.last.get(tenant)
        if next_turn and prev is not None:   # its sequence so far and a few new tokens
            prompt = prev.tokens[:len(prev.tokens) - 1] + [(first + i) % 64 for i in range(extra)]
        else:
            prompt = [(first + 7 * i) % 64 for i in range(length)]
        need = len(prompt) + max_tokens
        fits = need + 1 <= min(self.engine.max_request_tokens,
                               self.quotas.cap(tenant, HOT) - self.engine.cache.config.block_tokens)
        req = EngineRequest(prompt, SamplingParams(max_tokens=max_tokens), namespace=tenant)
        try:
            self.engine.submit(req)
        except InvalidInputError as exc:
            assert not fits, f"refused although it fits under its tenant's HOT cap: {exc}"
            assert "tenant_quotas hot.cap" in str(exc) or "for one request" in str(exc), str(exc)
            return
        assert fits, "accepted although it passes its tenant's HOT cap"
        self.requests.append(req)

    @rule(k=st.integers(1, 6))
    def step(self, k):
        for _ in range(k):
            self._step()

    @precondition(lambda self: any(not r.finished for r in self.requests))
    @rule(i=st.integers(0, 50))
    def cancel(self, i):
        live = [r for r in self.requests if not r.finished]
        self.engine.cancel(live[i % len(live)], FinishReason.CANCELLED)
        self._settle()

    # ------------------------------------------------------------ bookkeeping
    @property
    def lending(self) -> bool:
        return self.engine.scheduler.tenant_work.lending_waiting

    def _step(self) -> None:
        engine = self.engine
        if self.lending:   # only ever while nothing runs (a move in flight: the lent room's promotion)
            assert not engine.scheduler.running
        # The tenants with work and whether the waiting ones' guarantees are lent, as the cache is
        # told for the whole step (``TenantWork.before_step``): a step that plans a request again
        # ends the lending for the next one, not for its own update's checkpoints.
        self.kept_from = ({r.namespace for r in engine.scheduler.running},
                          {r.namespace for r in engine.scheduler.waiting}, self.lending)
        self.now += 1.0
        computed = engine.stats["steps"]
        self._count_slotless()
        try:
            engine.step()
        finally:
            self.kept_from = None
        self.l3.run_pending()   # L3's I/O, as its thread would have done meanwhile
        idle = (engine.stats["steps"] == computed and engine.scheduler.waiting and not engine.scheduler.running
                and not engine.cache.in_flight())
        self.idle_steps = self.idle_steps + 1 if idle else 0
        assert self.idle_steps <= IDLE_STEPS, (
            f"accepted requests waited {self.idle_steps} steps on an idle engine: "
            f"{[(r.namespace, len(r.tokens)) for r in engine.scheduler.waiting]}")
        self._settle()

    def _count_slotless(self) -> None:
        """Running slots under the fair share: a tenant with waiting work and no running request,
        while every slot is taken and another tenant holds more than its share of them
        (``max_running`` over the tenants with work, at least 1), runs a request within
        ``SLOT_STEPS`` steps (counted before each step)."""
        s = self.engine.scheduler
        held = Counter(r.namespace for r in s.running)
        tenants = set(held) | {r.namespace for r in s.waiting}
        share = max(1, s.config.max_running // len(tenants)) if tenants else 0
        starved = len(s.running) >= s.config.max_running and any(n > share for n in held.values())
        waiting = {r.namespace for r in s.waiting if r.yielded_to is None} - set(held) if starved else set()
        self.slotless = {t: self.slotless.get(t, 0) + 1 for t in waiting}
        for t, n in self.slotless.items():
            assert n <= SLOT_STEPS, (f"tenant {t!r} had waiting work and no running request for {n} steps: "
                                     f"running {[(r.namespace, len(r.tokens)) for r in s.running]}")

    def _settle(self) -> None:
        for r in self.requests:
            if r.finished:
                assert r.error is None, r.error
                if r.finish_reason is not FinishReason.CANCELLED:
                    self.last[r.namespace] = r
        self.caps_hold()

    @invariant()
    def caps_hold(self):
        """Counted here from the tree, the running requests' leases and the moves in flight
        (what a move will add to a tier, or take from it: checked by ``check_invariants``)."""
        cache, q = self.engine.cache, self.quotas
        held = {(t, tier): cache.space.pending_by_tenant[tier].get(t, 0) for t in TENANTS for tier in range(3)}
        for node in cache.tree.iter_nodes():
            held[cache.tree.namespace_of(node), node.tier] += len(node.key)
        for r in self.engine.scheduler.running:
            held[r.namespace, HOT] += r.lease.uncommitted
        for (t, tier), n in held.items():
            assert n <= q.cap(t, tier), f"tenant {t!r} holds {n} tokens of tier {tier}, past its cap {q.cap(t, tier)}"

    @invariant()
    def l3_shares_hold(self):
        """Counted in the store itself: each tenant's blocks there (by the tenant each was
        written for) and all of them together."""
        if not hasattr(self, "l3") or not self.quotas.config.l3_blocks:   # l3_blocks 0: L3 not under quotas
            return
        self.l3.run_pending()   # writes a commit queued (a cancel commits too), as the I/O thread would
        self.engine.cache.apply_l3()
        held: dict = {}
        for h, tenant in self.l3_tenant.items():
            if self.store.contains([self.l3.key(h)])[0]:
                held[tenant] = held.get(tenant, 0) + 1
        for tenant, n in held.items():
            assert n <= self.quotas.cap(tenant, L3_INDEX), (
                f"tenant {tenant!r} holds {n} L3 blocks, past its share {self.quotas.cap(tenant, L3_INDEX)}")
        assert sum(held.values()) <= self.quotas.config.l3_blocks
        assert held == {t: n for t in TENANTS if (n := self.quotas.holds(t, L3_INDEX))}, \
            "the quotas' L3 count is not what the store holds"

    @invariant()
    def cache_whole(self):
        cache = self.engine.cache
        cache.check_invariants()
        assert cache.stats["dropped_with_room_tokens"] == 0
        assert cache.stats["commit_tail_discarded_tokens"] == 0

    def teardown(self):
        steps = 0
        while self.engine.has_work():
            self._step()
            steps += 1
            assert steps < 1000, "the engine stopped making progress"
        self.engine.cache.wait_all()
        self.engine.cache.poll()
        self.cache_whole()
        assert all(r.finished and r.error is None for r in self.requests)
        assert self.engine.cache.protected_tokens == 0 and not self.quotas.running
        self.engine.cache.close()
        self.dir.cleanup()


TenantMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
test_every_accepted_request_is_served_within_its_quotas = TenantMachine.TestCase


def test_a_tenant_whose_warm_cap_is_under_a_block_does_not_hold_hot_for_good():
    """A case the machine found with a drawn configuration: every tenant's WARM cap is 9 tokens
    (under the 29-token node a request needs room from), and the HOT nodes have their tails
    further down (COLD): they could neither go down nor be dropped, and A's request waited on
    an idle engine for good. Their part that fits the cap goes down; what never can, goes."""
    m = TenantMachine()
    m.build(config={"l3_blocks": 0, "default": {"warm": {"cap": 0.1}}, "tenants": {}}, time_slice=False)
    m.submit(extra=1, first=0, length=18, max_tokens=3, next_turn=False, tenant="U1")
    m.step(k=3)
    m.cancel(i=0)
    m.step(k=3)
    m.submit(extra=1, first=0, length=14, max_tokens=2, next_turn=False, tenant="B")
    m.submit(extra=1, first=1, length=30, max_tokens=2, next_turn=False, tenant="A")
    m.step(k=6)
    m.submit(extra=1, first=0, length=2, max_tokens=1, next_turn=False, tenant="A")
    m.cancel(i=0)
    m.step(k=1)
    m.submit(extra=1, first=0, length=2, max_tokens=1, next_turn=False, tenant="A")
    m.submit(extra=1, first=0, length=29, max_tokens=1, next_turn=False, tenant="A")
    m.step(k=6)   # each step checks that no accepted request waits on an idle engine
    assert not m.engine.has_work()
    assert all(r.finished and r.error is None for r in m.requests) and len(m.requests) == 6
    m.teardown()
