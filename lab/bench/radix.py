"""``prefix-cache bench radix``: match + insert throughput of the radix tree.

Replays a Mooncake-format trace (by default one generated with the structure
of real workloads, ``lab.bench.traces``: conversations, tool-agent loops,
long shared prompts, one-off prompts) through the cycle a server runs per
request: encode the prompt once, match the prefix, lock it, make room (LRU
eviction at a token capacity), insert, unlock. Every request does all of it,
a full hit included (SGLang's scheduler does too). No KV tensors: this
measures the index.

``--compare-sglang`` replays the same token sequences through SGLang's
``RadixCache`` (``lab.bench.sglang_baseline``). Each run of each arm is a
forked child process, so arms share nothing but the input and each reports
its own peak RSS; the input lists are frozen out of the garbage collector
(``gc.freeze``) in both, since they belong to the harness, not the cache.
The arms alternate, best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import time

from cluster.cache.allocator import AllocatorConfig, BlockAllocator
from cluster.cache.radix_tree import RadixTree
from cluster.cache.token_key import TOKEN_BYTES, encode_tokens
from cluster.errors import PoolExhaustedError
from cluster.trace import TokenExpander, load_trace, synthetic_multiturn
from lab.bench.common import emit, rounded
from lab.bench.footprint import footprint, per_token


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", help="Mooncake-format JSONL trace (default: a generated trace, see --shape)")
    p.add_argument("--shape", default="mixed",
                   help="generated trace shape (lab.bench.traces: conversation, tool_agent, long_system, "
                        "one_off, bursts, mixed) or 'multiturn' for the older synthetic trace (default mixed)")
    p.add_argument("--seed", type=int, default=0, help="generated trace seed")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--trace-block-tokens", type=int, default=None,
                   help="tokens per hash id in the trace (default 512 for --trace, block-tokens when generated)")
    p.add_argument("--records", type=int, default=20_000, help="records to replay (default 20000)")
    p.add_argument("--capacity-tokens", type=int, default=0, help="cache capacity in tokens, 0 = unbounded")
    p.add_argument("--policy", default="lru", choices=["lru", "lfu"], help="eviction policy")
    p.add_argument("--repeats", type=int, default=3, help="runs per implementation; the fastest is reported")
    p.add_argument("--block-hashes", action="store_true",
                   help="also keep each node's block hashes (what a worker with KV events does)")
    p.add_argument("--compare-sglang", action="store_true",
                   help="also replay through SGLang's RadixCache (needs sglang importable)")


def replay(sequences: list[list[int]], block_tokens: int, capacity_tokens: int, policy: str = "lru",
           block_hashes: bool = False) -> dict:
    total = sum(len(s) for s in sequences)
    cap = capacity_tokens if capacity_tokens > 0 else total + block_tokens * len(sequences)
    alloc = BlockAllocator(AllocatorConfig(num_blocks=max(1, -(-cap // block_tokens)), block_tokens=block_tokens))
    tree = RadixTree(alloc, policy=policy, hash_block_tokens=block_tokens if block_hashes else None)
    hit = 0
    start = time.perf_counter()
    for seq in sequences:
        key = encode_tokens(seq, validate=False)  # once per request, as SGLang builds its RadixKey
        m = tree.match_prefix(key, validate=False)
        hit += m.length
        rest = len(key) // TOKEN_BYTES - m.length
        tree.lock(m.last_node)
        try:
            ext = []
            while rest:
                try:
                    ext = alloc.allocate(rest)
                    break
                except PoolExhaustedError as exc:
                    if tree.evict(max(exc.needed_blocks - exc.free_blocks, 1) * block_tokens) == 0:
                        raise
            tree.insert(key, ext, start=m.length, validate=False)
        finally:
            tree.unlock(m.last_node)
    seconds = time.perf_counter() - start
    nodes = sum(1 for _ in tree.iter_nodes())
    objects, index_bytes = footprint(list(tree.roots.values()))
    cached = tree.total_tokens
    return {"records": len(sequences), "tokens": total, "seconds": rounded(seconds),
            "match_insert_per_s": rounded(len(sequences) / seconds, 1), "tokens_per_s": rounded(total / seconds, 1),
            "hit_rate": rounded(hit / total if total else 0.0), "nodes": nodes,
            "evicted_tokens": tree.stats["evicted_tokens"], "cached_tokens": cached,
            **per_token(nodes, objects, index_bytes, cached)}


def _vm_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _child(conn, fn, args) -> None:
    gc.freeze()  # the input belongs to the harness: no arm's collections walk it
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset the peak-RSS mark to the current RSS
    except OSError:
        pass
    before = _vm_kib("VmRSS")
    result = fn(*args)
    result["peak_rss_mb"] = rounded(_vm_kib("VmHWM") / 1024, 1)
    result["rss_growth_mb"] = rounded((_vm_kib("VmHWM") - before) / 1024, 1)
    conn.send(result)
    conn.close()


def in_child(fn, *args) -> dict:
    """Run ``fn(*args)`` in a forked child; returns its result dict."""
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, fn, args))
    proc.start()
    send.close()
    try:
        result = recv.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"benchmark child exited with code {proc.exitcode}") from None
    proc.join()
    return result


def load_sequences(args: argparse.Namespace) -> list[list[int]]:
    if args.trace:
        records = load_trace(args.trace, limit=args.records)
        tbt = args.trace_block_tokens or 512
    elif args.shape == "multiturn":
        records = synthetic_multiturn(args.records, block_tokens=args.block_tokens, seed=args.seed)
        tbt = args.trace_block_tokens or args.block_tokens
    else:
        from lab.bench.traces import shape_trace

        records = shape_trace(args.shape, args.records, seed=args.seed, block_tokens=args.block_tokens)[:args.records]
        tbt = args.trace_block_tokens or args.block_tokens
    expander = TokenExpander(args.block_tokens, trace_block_tokens=tbt)
    return [s for s in (expander.tokens(r) for r in records) if s]


def run(args: argparse.Namespace) -> int:
    sequences = load_sequences(args)
    base = {"bench": "radix", "impl": "prefix-cache", "trace": args.trace or args.shape,
            "block_tokens": args.block_tokens, "capacity_tokens": args.capacity_tokens, "policy": args.policy,
            "repeats": args.repeats, "block_hashes": args.block_hashes}
    fastest = lambda runs: min(runs, key=lambda r: r["seconds"])  # noqa: E731 - best of N on a shared box
    ours_args = (sequences, args.block_tokens, args.capacity_tokens, args.policy, args.block_hashes)
    if args.compare_sglang:
        from lab.bench.sglang_baseline import check_sglang, run_sglang_replay

        check_sglang()  # fail before spending time on our arm
        ours_runs, their_runs = [], []
        for _ in range(args.repeats):  # alternating, so both see the same machine
            ours_runs.append(in_child(replay, *ours_args))
            their_runs.append(in_child(run_sglang_replay, sequences, args.capacity_tokens))
        ours, theirs = fastest(ours_runs), fastest(their_runs)
        ours["speedup_vs_sglang"] = rounded(ours["tokens_per_s"] / theirs["tokens_per_s"], 2)
        emit({**base, **ours})
        emit({**base, **theirs, "impl": "sglang", "policy": "lru", "block_hashes": False})
    else:
        emit({**base, **fastest([in_child(replay, *ours_args) for _ in range(args.repeats)])})
    return 0
