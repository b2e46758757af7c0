"""The summaries of ``bench serving``: one pair's ratios of our arm to the peer and its goals
(``compare_sessions``, ``_compare``), and the spread over pairs (``_over_pairs``).
Split out of ``lab.bench.serving``, which imports them under the same names."""

from __future__ import annotations

import statistics

from lab.bench.common import rounded

# Drops a full cache is allowed: the last tier's own eviction, and an explicit flush.
DROP_REASONS_WITHOUT_ROOM = ("last_tier", "flush")


def dropped_for_other_reasons(by_reason: dict | None) -> int | None:
    """Tokens dropped for a reason other than the last tier's eviction or a flush, counting any
    part of the total no reason accounts for (None: not reported)."""
    if by_reason is None:
        return None
    reasons = {k: v for k, v in by_reason.items() if "/" in k}
    allowed = sum(v for k, v in reasons.items() if k.split("/", 1)[1] in DROP_REASONS_WITHOUT_ROOM)
    return sum(reasons.values()) - allowed + max(0, by_reason.get("dropped_tokens", 0) - sum(reasons.values()))


RATIO_SUFFIXES = ("_vs_peer", "_vs_same_hot", "_vs_all_memory", "_vs_same_memory")


def _over_pairs(compares: list[dict]) -> dict:
    """The median, lowest and highest of each ratio over the pairs, and how many pairs met each
    goal: on a machine whose run-to-run spread is as wide as the gap, one pair decides nothing."""
    out: dict = {"pairs": len(compares)}
    for key in compares[0]:
        if key.endswith(RATIO_SUFFIXES):
            values = [c[key] for c in compares if c.get(key) is not None]
            if values:
                out[f"{key}_median"] = rounded(statistics.median(values), 3)
                out[f"{key}_min"], out[f"{key}_max"] = min(values), max(values)
        elif key.startswith("goal_"):
            out[f"{key}_pairs"] = sum(1 for c in compares if c.get(key))
    return out


def _compare(ours: dict, peer: dict) -> dict:
    def ratio(key: str) -> float | None:
        return rounded(ours[key] / peer[key], 3) if ours.get(key) and peer.get(key) else None

    out = {"throughput_vs_peer": ratio("output_tokens_per_s")}
    for key in ("ttft_ms_p50", "ttft_ms_p99", "ttft_ms_first_turn_p50", "ttft_ms_later_turns_p50", "e2e_ms_p50",
                "tpot_ms_p50"):
        out[f"{key}_vs_peer"] = ratio(key)
    out["goal_no_failures"] = ours["failed"] == 0
    out["goal_throughput_ge_peer"] = (out["throughput_vs_peer"] or 0) >= 1.0
    out["goal_ttft_le_peer"] = all((out[f"{k}_vs_peer"] or 99) <= 1.0 for k in
                                   ("ttft_ms_p50", "ttft_ms_p99", "ttft_ms_first_turn_p50", "ttft_ms_later_turns_p50"))
    out["goal_cached_share_ge_peer_hit_rate"] = ours["cached_token_share"] >= (peer.get("prefix_cache_hit_rate") or 0)
    return out


def _at_most(value: float | None, bound: float | None) -> bool | None:
    """value <= bound; None when there is no bound (its arm did not run), False when no value."""
    if bound is None:
        return None
    return value is not None and value <= bound


def _at_least(value: float | None, bound: float | None) -> bool | None:
    if bound is None:
        return None
    return value is not None and value >= bound


def compare_sessions(ours: dict, same_hot: dict | None, all_memory: dict | None) -> dict:
    """The sessions workload's summary: our arm's ratios to each vLLM arm that ran (None where
    it did not) and its goals (None where the arm a goal needs did not run)."""
    def ratio(key: str, peer: dict | None) -> float | None:
        if peer is None or not ours.get(key) or not peer.get(key):
            return None
        return rounded(ours[key] / peer[key], 3)

    def scaled(peer: dict | None, key: str, factor: float) -> float | None:
        return peer[key] * factor if peer is not None and peer.get(key) is not None else None

    out: dict = {"workload": "sessions"}
    for suffix, peer in (("same_hot", same_hot), ("all_memory", all_memory)):
        out[f"throughput_vs_{suffix}"] = ratio("output_tokens_per_s", peer)
        for key in ("ttft_ms_later_turns_p50", "ttft_ms_later_turns_p99"):
            out[f"{key}_vs_{suffix}"] = ratio(key, peer)
    later_p50, later_p99 = ours.get("ttft_ms_later_turns_p50"), ours.get("ttft_ms_later_turns_p99")
    tokens_per_s = ours.get("output_tokens_per_s")
    out["dropped_not_last_tier_or_flush_tokens"] = dropped_for_other_reasons(ours.get("dropped_tokens_by_reason"))
    out["goal_no_failures"] = ours.get("failed") == 0
    out["goal_later_cached_share_ge_0_9"] = (ours.get("later_turns_cached_share") or 0.0) >= 0.9
    out["goal_later_ttft_p50_le_0_2x_same_hot"] = _at_most(later_p50, scaled(same_hot, "ttft_ms_later_turns_p50", 0.2))
    out["goal_later_ttft_p50_le_1_2x_all_memory"] = _at_most(later_p50,
                                                             scaled(all_memory, "ttft_ms_later_turns_p50", 1.2))
    out["goal_later_ttft_p99_le_same_hot"] = _at_most(later_p99, scaled(same_hot, "ttft_ms_later_turns_p99", 1.0))
    out["goal_throughput_ge_1_5x_same_hot"] = _at_least(tokens_per_s, scaled(same_hot, "output_tokens_per_s", 1.5))
    out["goal_throughput_ge_0_9x_all_memory"] = _at_least(tokens_per_s,
                                                          scaled(all_memory, "output_tokens_per_s", 0.9))
    # The cache's own count: tokens that left a tier while the tier below had room for them.
    with_room = ours.get("dropped_with_room_tokens")
    out["goal_no_dropped_with_room"] = None if with_room is None else with_room == 0
    held = ours.get("recomputed_held_tokens")
    out["goal_no_recomputed_held"] = None if held is None else held == 0
    return out
