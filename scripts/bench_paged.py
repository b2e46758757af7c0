"""Decode step time (and one prefill's), forward_into (per-request head-major buffers) against forward_paged
(K/V read in place from a slotted pool through slot tables), on the default real model,
in the same run with the arms in turns. One JSON line per (batch, arm).

    flock /tmp/heavy.lock python3 scripts/bench_paged.py --batches 8 16 --positions 800
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from cluster.engine.checkpoint import ModelSpec, load_model


def setup(model, batch: int, positions: int, block_tokens: int, seed: int):
    """``batch`` sequences of ``positions`` cached positions each, in buffers and in a pool
    whose blocks are dealt out shuffled (as a slotted allocator hands them out after churn);
    random K/V, the same bytes in both."""
    c = model.config
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-(positions + 1) // block_tokens)
    num_blocks = batch * per_seq + 1
    pool = torch.zeros(num_blocks, c.num_layers, 2, block_tokens, c.num_kv_heads, c.head_dim)
    order = torch.randperm(num_blocks, generator=g)
    into, paged = [], []
    for b in range(batch):
        blocks = order[b * per_seq:(b + 1) * per_seq]
        slots = (blocks[:, None] * block_tokens + torch.arange(block_tokens)).flatten()[:positions + 1]
        kv = torch.randn(c.num_layers, 2, positions, c.num_kv_heads, c.head_dim, generator=g) * 0.5
        pool[slots[:positions] // block_tokens, :, :, slots[:positions] % block_tokens] = kv.permute(2, 0, 1, 3, 4)
        buf = torch.zeros(c.num_layers, 2, c.num_kv_heads, positions + 1, c.head_dim)
        buf[:, :, :, :positions] = kv.transpose(2, 3)
        token = torch.randint(1000, 2000, (1,), generator=g)
        into.append((token, positions, buf))
        paged.append((token, positions, slots))
    return into, paged, pool


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--batches", type=int, nargs="+", default=[8, 16])
    p.add_argument("--positions", type=int, default=800)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(ModelSpec.parse(args.model))
    model = loaded.model
    model.use_decode_kernel(True)
    model.tune_linears()
    for batch in args.batches + [0]:   # 0: a prefill of ``positions`` tokens from position 0
        into, paged, pool = setup(model, max(batch, 1), args.positions, args.block_tokens, seed=batch)
        if batch == 0:
            tokens = torch.randint(1000, 2000, (args.positions,), generator=torch.Generator().manual_seed(1))
            into = [(tokens, 0, into[0][2])]
            paged = [(tokens, 0, paged[0][2][:args.positions])]
        arms = {"forward_into": lambda: model.forward_into(into, last_logits_only=True),
                "forward_paged": lambda: model.forward_paged(paged, pool, last_logits_only=True)}
        times = {name: [] for name in arms}
        for fn in arms.values():   # warm-up
            fn()
        for _ in range(args.steps):
            for name, fn in arms.items():   # in turns: a burst of other load hits both
                began = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - began)
        logits_equal = all(torch.equal(a, b) for a, b in zip(arms["forward_into"](), arms["forward_paged"]()))
        for name, samples in times.items():
            print(json.dumps({"bench": "paged_decode" if batch else "paged_prefill", "model": loaded.model_id,
                              "arm": name, "batch": max(batch, 1),
                              "positions": args.positions, "block_tokens": args.block_tokens,
                              "threads": args.threads, "steps": args.steps,
                              "median_ms": round(1000 * statistics.median(samples), 2),
                              "min_ms": round(1000 * min(samples), 2), "logits_equal": logits_equal,
                              "compiled_loop": model._compiled_layers is not None}), flush=True)


if __name__ == "__main__":
    main()
