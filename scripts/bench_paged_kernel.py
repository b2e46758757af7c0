"""One layer's batched attention alone: extend_attention over per-sequence head-major buffers
against paged_attention over a slotted pool (blocks dealt out shuffled), the same K/V bytes,
SmolLM2-135M's shapes; the arms in turns, results checked equal.

    flock /tmp/heavy.lock python3 scripts/bench_paged_kernel.py THREADS
"""
import time, torch, sys
from cluster.engine import kernels
ext, pag = kernels.extend_attention(), kernels.paged_attention()
torch.set_num_threads(int(sys.argv[1]))
L, KVH, D, H, BT, P = 30, 3, 64, 9, 16, 800
for B in (8, 16):
    g = torch.Generator().manual_seed(0)
    per = -(-(P + 1) // BT); nb = B * per
    pool = torch.randn(nb, L, 2, BT, KVH, D, generator=g)
    order = torch.randperm(nb, generator=g)
    bufs, tabs = [], []
    for b in range(B):
        blocks = order[b*per:(b+1)*per]
        slots = (blocks[:, None]*BT + torch.arange(BT)).flatten()[:P+1]
        tabs.append(slots)
        bufs.append(pool[slots//BT, :, :, slots % BT].permute(1, 2, 3, 0, 4).contiguous())
    q = torch.randn(B, H, D, generator=g); k = torch.randn(B, KVH, D, generator=g); v = torch.randn(B, KVH, D, generator=g)
    slots = torch.cat(tabs); starts = [0]
    for t in tabs: starts.append(starts[-1] + t.numel())
    t_e, t_p = [], []
    for r in range(200):
        layer = r % L
        a = time.perf_counter(); o1 = ext(q, k, v, bufs, layer, [P]*B, [1]*B, 0.125, [], []); t_e.append(time.perf_counter()-a)
        a = time.perf_counter(); o2 = pag(q, k, v, pool, layer, slots, starts, [P]*B, [1]*B, 0.125); t_p.append(time.perf_counter()-a)
    assert torch.equal(o1, o2)
    import statistics as s
    print(f"B={B} threads={sys.argv[1]} extend min {min(t_e)*1e6:.0f}us med {s.median(t_e)*1e6:.0f}us | paged min {min(t_p)*1e6:.0f}us med {s.median(t_p)*1e6:.0f}us")
