"""Per-tenant quotas of the cache's tiers: the config (``tenant_quotas``) and its checks.

A tenant is a cache namespace (each API key's tenant is its own namespace;
``None`` is the shared namespace of a deployment without keys). Each gets, in
each tier, a guaranteed share and a cap, both fractions of that tier's
capacity (HOT, WARM and COLD in tokens; L3 of ``l3_blocks``, the blocks one
replica may keep written in L3 for all tenants together):

    tenant_quotas:
      l3_blocks: 8192
      default: {hot: {guarantee: 0.1, cap: 0.5}, warm: {cap: 0.5}}
      tenants: {team-b: {hot: {guarantee: 0.5, cap: 1.0}}}
      keys: {sk-live-123: {warm: {guarantee: 0.25}}}     # resolved to the key's tenant by the app
      step_tokens: 32          # the engine step's token budget while tenants share the engine
      active_window_s: 30      # ... that is, while another tenant was seen this recently

A tier left out of a quota is unlimited (guarantee 0, cap 1). The rules the
cache keeps with them: ``cluster.cache.quotas``; the engine's per-tenant fair
share of each step (``step_tokens``): ``cluster.engine.fair_share``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping

from cluster.errors import InvalidInputError

QUOTA_TIERS = ("hot", "warm", "cold", "l3")   # index = cluster.names tier (HOT=0, WARM=1, COLD=2), L3=3
L3_INDEX = 3
_TOP_KEYS = ("default", "tenants", "keys", "l3_blocks", "step_tokens", "active_window_s")
DEFAULT_ACTIVE_WINDOW_S = 30.0


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidInputError(f"{where} must be a number in [0, 1], got {value!r}")
    if not 0.0 <= value <= 1.0:
        raise InvalidInputError(f"{where} must be in [0, 1] (a share of the tier), got {value!r}")
    return float(value)


@dataclass(frozen=True)
class TierShare:
    """A tenant's share of one tier: kept for it (``guarantee``), and the most it may hold (``cap``)."""
    guarantee: float = 0.0
    cap: float = 1.0

    @classmethod
    def parse(cls, data: Any, where: str) -> "TierShare":
        if not isinstance(data, Mapping):
            raise InvalidInputError(f"{where} must be a mapping with 'guarantee' and/or 'cap', got {data!r}")
        unknown = set(data) - {"guarantee", "cap"}
        if unknown:
            raise InvalidInputError(f"{where}: unknown keys {sorted(map(str, unknown))} (use 'guarantee', 'cap')")
        guarantee = _number(data.get("guarantee", 0.0), f"{where}.guarantee")
        cap = _number(data.get("cap", 1.0), f"{where}.cap")
        if cap <= 0.0:
            raise InvalidInputError(f"{where}.cap must be > 0 (a tenant must be able to hold something)")
        if guarantee > cap:
            raise InvalidInputError(f"{where}: guarantee {guarantee} exceeds cap {cap}")
        return cls(guarantee, cap)


UNLIMITED = TierShare()


@dataclass(frozen=True)
class TenantQuota:
    """One tenant's shares, one per tier of ``QUOTA_TIERS``."""
    shares: tuple[TierShare, ...] = (UNLIMITED,) * len(QUOTA_TIERS)

    @classmethod
    def parse(cls, data: Any, where: str) -> "TenantQuota":
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise InvalidInputError(f"{where} must be a mapping of tiers {list(QUOTA_TIERS)} to shares, got {data!r}")
        unknown = set(data) - set(QUOTA_TIERS)
        if unknown:
            raise InvalidInputError(f"{where}: unknown tiers {sorted(map(str, unknown))} (tiers: {list(QUOTA_TIERS)})")
        return cls(tuple(TierShare.parse(data[t], f"{where}.{t}") if t in data else UNLIMITED
                         for t in QUOTA_TIERS))

    def to_dict(self) -> dict:
        return {t: {"guarantee": s.guarantee, "cap": s.cap} for t, s in zip(QUOTA_TIERS, self.shares)
                if s != UNLIMITED}


@dataclass(frozen=True)
class QuotaConfig:
    """Every tenant's quota: ``tenants`` by tenant id (keys already resolved), ``default`` for the rest."""
    default: TenantQuota = field(default_factory=TenantQuota)
    tenants: tuple[tuple[str, TenantQuota], ...] = ()
    l3_blocks: int = 0
    # The engine's step budget while more than one tenant was active within ``active_window_s``
    # (None: ``max_batch_tokens`` always; ``cluster.engine.fair_share``).
    step_tokens: int | None = None
    active_window_s: float = DEFAULT_ACTIVE_WINDOW_S

    def quota_of(self, namespace: Hashable) -> TenantQuota:
        for tenant, quota in self.tenants:
            if tenant == namespace:
                return quota
        return self.default

    @classmethod
    def parse(cls, data: Any, api_keys: Mapping[str, str] | None = None) -> "QuotaConfig":
        """``tenant_quotas`` as the app config spells it. ``keys`` entries need
        ``api_keys`` ({key: tenant}) and become their tenants' entries."""
        if isinstance(data, QuotaConfig):
            return data
        if not isinstance(data, Mapping):
            raise InvalidInputError(f"tenant_quotas must be a mapping with {list(_TOP_KEYS)}, got {data!r}")
        unknown = set(data) - set(_TOP_KEYS)
        if unknown:
            raise InvalidInputError(f"tenant_quotas: unknown keys {sorted(map(str, unknown))} "
                                    f"(keys: {list(_TOP_KEYS)})")
        l3_blocks = data.get("l3_blocks", 0)
        if isinstance(l3_blocks, bool) or not isinstance(l3_blocks, int) or l3_blocks < 0:
            raise InvalidInputError(f"tenant_quotas.l3_blocks must be a non-negative integer, got {l3_blocks!r}")
        step_tokens, window = _scheduling(data)
        default = TenantQuota.parse(data.get("default"), "tenant_quotas.default")
        tenants: dict[str, tuple[TenantQuota, str]] = {}
        for section in ("tenants", "keys"):
            entries = data.get(section) or {}
            if not isinstance(entries, Mapping):
                raise InvalidInputError(f"tenant_quotas.{section} must be a mapping, got {entries!r}")
            for name, spec in entries.items():
                where = f"tenant_quotas.{section}.{name}" if section == "tenants" else "tenant_quotas.keys[<a key>]"
                quota = TenantQuota.parse(spec, where)
                tenant = str(name) if section == "tenants" else _tenant_of_key(str(name), api_keys)
                if tenant in tenants and tenants[tenant][0] != quota:
                    raise InvalidInputError(f"{where}: tenant {tenant!r} already has a different quota "
                                            f"(from {tenants[tenant][1]})")
                tenants[tenant] = (quota, where)
        config = cls(default, tuple(sorted((t, q) for t, (q, _) in tenants.items())), l3_blocks,
                     step_tokens, window)
        config.check()
        return config

    def check(self) -> None:
        """Guarantees that fit each tier (the default's counted once, for the tenants not
        listed), and L3 shares only with an ``l3_blocks`` to take them of."""
        quotas = [q for _, q in self.tenants] + [self.default]
        for i, tier in enumerate(QUOTA_TIERS):
            total = sum(q.shares[i].guarantee for q in quotas)
            if total > 1.0 + 1e-9:
                raise InvalidInputError(
                    f"tenant_quotas: the {tier} guarantees add up to {total:g} (the listed tenants' and the "
                    f"default's), more than the whole tier: lower them to a sum of at most 1")
        if not self.l3_blocks and any(q.shares[L3_INDEX] != UNLIMITED for q in quotas):
            raise InvalidInputError("tenant_quotas: l3 shares need l3_blocks (the blocks one replica may "
                                    "keep written in L3 for all tenants)")

    def to_dict(self) -> dict:
        """The form ``parse`` reads (keys resolved to tenants)."""
        out = {"default": self.default.to_dict(), "tenants": {t: q.to_dict() for t, q in self.tenants},
               "l3_blocks": self.l3_blocks}
        if self.step_tokens is not None:   # the scheduling keys only when set
            out["step_tokens"] = self.step_tokens
        if self.active_window_s != DEFAULT_ACTIVE_WINDOW_S:
            out["active_window_s"] = self.active_window_s
        return out


def _scheduling(data: Mapping) -> tuple[int | None, float]:
    """``step_tokens`` (an integer >= 1, or absent) and ``active_window_s`` (seconds > 0)."""
    step = data.get("step_tokens")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 1):
        raise InvalidInputError(f"tenant_quotas.step_tokens must be an integer >= 1 (tokens per engine step "
                                f"while tenants share it), got {step!r}")
    window = data.get("active_window_s", DEFAULT_ACTIVE_WINDOW_S)
    if isinstance(window, bool) or not isinstance(window, (int, float)) or not 0 < window <= 86400:
        raise InvalidInputError(f"tenant_quotas.active_window_s must be a number of seconds in (0, 86400], "
                                f"got {window!r}")
    return step, float(window)


def _tenant_of_key(key: str, api_keys: Mapping[str, str] | None) -> str:
    if api_keys is None or key not in api_keys:
        # The key itself is never echoed: config errors end up in logs.
        raise InvalidInputError("tenant_quotas.keys names a key that is not among the configured api_keys "
                                f"({len(api_keys or {})} configured); list its tenant under tenant_quotas.tenants "
                                "or add the key")
    return api_keys[key]
