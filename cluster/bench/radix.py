"""``prefix-cache bench radix``: match + insert throughput of the radix tree.

Replays a Mooncake-format trace (or a built-in synthetic multi-turn trace)
through the cycle a server runs per request: match the prefix, lock it, make
room (LRU eviction at a token capacity), insert the new suffix, unlock. No KV
tensors: this measures the index. ``--compare-sglang`` replays the same token
sequences through SGLang's ``RadixCache`` in the same run when it is importable.
"""

from __future__ import annotations

import argparse
import time

from cluster.bench.common import emit, rounded
from cluster.cache.allocator import AllocatorConfig, BlockAllocator
from cluster.cache.radix_tree import RadixTree
from cluster.errors import PoolExhaustedError
from cluster.tokens import as_token_list
from cluster.trace import TokenExpander, load_trace, synthetic_multiturn


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", help="Mooncake-format JSONL trace (default: built-in synthetic multi-turn trace)")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--trace-block-tokens", type=int, default=None,
                   help="tokens per hash id in the trace (default 512 for --trace, block-tokens for synthetic)")
    p.add_argument("--records", type=int, default=20_000, help="records to replay (default 20000)")
    p.add_argument("--capacity-tokens", type=int, default=0, help="cache capacity in tokens, 0 = unbounded")
    p.add_argument("--policy", default="lru", choices=["lru", "lfu"], help="eviction policy")
    p.add_argument("--repeats", type=int, default=3, help="runs per implementation; the fastest is reported")
    p.add_argument("--compare-sglang", action="store_true",
                   help="also replay through SGLang's RadixCache (needs sglang importable)")


def replay(sequences: list[list[int]], block_tokens: int, capacity_tokens: int, policy: str = "lru") -> dict:
    total = sum(len(s) for s in sequences)
    cap = capacity_tokens if capacity_tokens > 0 else total + block_tokens * len(sequences)
    alloc = BlockAllocator(AllocatorConfig(num_blocks=max(1, -(-cap // block_tokens)), block_tokens=block_tokens))
    tree = RadixTree(alloc, policy=policy)
    hit = 0
    start = time.perf_counter()
    for seq in sequences:
        seq = as_token_list(seq)  # validated once, as an ingress would
        m = tree.match_prefix(seq, validate=False)
        hit += m.length
        rest = len(seq) - m.length
        if rest == 0:
            continue
        tree.lock(m.last_node)
        try:
            while True:
                try:
                    ext = alloc.allocate(rest)
                    break
                except PoolExhaustedError as exc:
                    if tree.evict(max(exc.needed_blocks - exc.free_blocks, 1) * block_tokens) == 0:
                        raise
            tree.insert(seq, ext, start=m.length, validate=False)
        finally:
            tree.unlock(m.last_node)
    seconds = time.perf_counter() - start
    return {"records": len(sequences), "tokens": total, "seconds": rounded(seconds),
            "match_insert_per_s": rounded(len(sequences) / seconds, 1), "tokens_per_s": rounded(total / seconds, 1),
            "hit_rate": rounded(hit / total if total else 0.0), "nodes": sum(1 for _ in tree.iter_nodes()),
            "evicted_tokens": tree.stats["evicted_tokens"]}


def run(args: argparse.Namespace) -> int:
    if args.trace:
        records = load_trace(args.trace, limit=args.records)
        tbt = args.trace_block_tokens or 512
    else:
        records = synthetic_multiturn(args.records, block_tokens=args.block_tokens)
        tbt = args.trace_block_tokens or args.block_tokens
    expander = TokenExpander(args.block_tokens, trace_block_tokens=tbt)
    sequences = [expander.tokens(r) for r in records]
    sequences = [s for s in sequences if s]
    base = {"bench": "radix", "impl": "prefix-cache", "block_tokens": args.block_tokens,
            "capacity_tokens": args.capacity_tokens, "repeats": args.repeats}
    fastest = lambda runs: min(runs, key=lambda r: r["seconds"])  # noqa: E731 - best of N on a shared box
    if args.compare_sglang:
        from cluster.bench.sglang_baseline import run_sglang_replay

        ours_runs, their_runs = [], []
        for _ in range(args.repeats):  # interleaved, so both see the same machine
            ours_runs.append(replay(sequences, args.block_tokens, args.capacity_tokens, args.policy))
            their_runs.append(run_sglang_replay(sequences, args.capacity_tokens))
        ours, theirs = fastest(ours_runs), fastest(their_runs)
        ours["speedup_vs_sglang"] = rounded(ours["match_insert_per_s"] / theirs["match_insert_per_s"], 2)
        emit({**base, **ours})
        emit({**base, **theirs, "impl": "sglang"})
    else:
        emit({**base, **fastest([replay(sequences, args.block_tokens, args.capacity_tokens, args.policy)
                                 for _ in range(args.repeats)])})
    return 0
