"""Shared-prefix reads (cluster.engine.shared_prefix): requests whose working buffers
begin with the same checked bytes read them from one buffer in the attention kernel,
with the same results bit for bit."""

from types import SimpleNamespace

import pytest
import torch

from cluster.cache.kv_pool import KVLayout
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.engine import shared_prefix
from cluster.engine.model import DecoderModel, ModelConfig
from cluster.engine.runner import Engine, EngineRequest, SamplingParams
from tests.requirements import KERNELS, require

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _kernel(head_dim: int):
    cfg = ModelConfig(num_layers=2, hidden_size=3 * head_dim, num_heads=3, num_kv_heads=1, head_dim=head_dim,
                      intermediate_size=64, seed=4)
    model = DecoderModel(cfg)
    require(KERNELS, model.use_decode_kernel(True) and model._extend_kernel is not None,
            "the attention kernels could not be built here")
    return model._extend_kernel


@pytest.mark.parametrize("head_dim", [64, 16])   # the AVX2 path and the generic one
def test_reading_a_prefix_from_a_lender_gives_the_same_bits(head_dim):
    """Four sequences whose buffers begin with the same 37 positions (not a multiple of the
    kernel's four keys at a time), decoding and extending; three read those positions from
    the first's buffer, one from its own: every output equals the one without lending."""
    kernel = _kernel(head_dim)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randn(2, 2, 1, 37, head_dim, generator=g)
    starts, counts = [40, 37, 52, 45], [1, 3, 1, 5]
    buffers = []
    for s, n in zip(starts, counts):
        buf = torch.randn(2, 2, 1, s + n + 3, head_dim, generator=g)
        buf[:, :, :, :37] = prefix
        buffers.append(buf)
    total = sum(counts)
    q = torch.randn(total, 3, head_dim, generator=g) * 3
    k_new, v_new = torch.randn(total, 1, head_dim, generator=g), torch.randn(total, 1, head_dim, generator=g)
    own = kernel(q, k_new, v_new, [b.clone() for b in buffers], 1, starts, counts, head_dim ** -0.5)
    lent = kernel(q, k_new, v_new, buffers, 1, starts, counts, head_dim ** -0.5, [-1, 0, 0, 0], [0, 37, 37, 20])
    assert torch.equal(lent, own)
    # The lender's rows really are read: lend it other bytes and the borrowers' outputs move.
    buffers[0][1, :, :, :37] += 1.0
    moved = kernel(q, k_new, v_new, buffers, 1, starts, counts, head_dim ** -0.5, [-1, 0, 0, 0], [0, 37, 37, 20])
    assert not torch.equal(moved[1:], own[1:])


def test_the_kernel_refuses_reads_past_what_lender_or_borrower_computed():
    kernel = _kernel(64)
    bufs = [torch.zeros(2, 2, 1, 16, 64) for _ in range(2)]
    q, kv = torch.zeros(2, 3, 64), torch.zeros(2, 1, 64)
    with pytest.raises(RuntimeError, match="more than its own"):
        kernel(q, kv, kv, bufs, 0, [8, 4], [1, 1], 0.125, [-1, 0], [0, 6])   # the borrower has 4
    with pytest.raises(RuntimeError, match="more than its own"):
        kernel(q, kv, kv, bufs, 0, [4, 8], [1, 1], 0.125, [-1, 0], [0, 6])   # the lender has 4
    with pytest.raises(RuntimeError, match="not a sequence of the call"):
        kernel(q, kv, kv, bufs, 0, [8, 8], [1, 1], 0.125, [-1, 2], [0, 4])
    with pytest.raises(RuntimeError, match="one each per sequence"):
        kernel(q, kv, kv, bufs, 0, [8, 8], [1, 1], 0.125, [-1], [0])


def _req(tokens, kv, namespace=None):
    return SimpleNamespace(tokens=list(tokens), _len=len(tokens), _kv=kv, namespace=namespace,
                           _kv_group=None, _kv_shared=0, _kv_source=())


def test_join_checks_the_bytes_not_only_the_tokens(monkeypatch):
    monkeypatch.setattr(shared_prefix, "MIN_TOKENS", 4)
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(2, 2, 1, 32, 8, generator=g)
    a = _req(range(20), kv.clone())
    b = _req(list(range(12)) + [99] * 6, kv.clone())   # 12 tokens in common with a
    assert shared_prefix.join(b, [a]) == 12
    assert a._kv_group is b._kv_group and (a._kv_shared, b._kv_shared) == (12, 12)
    # The same tokens with KV computed otherwise (a last bit differs): not joined.
    c = _req(range(20), kv.clone())
    c._kv[1, 1, 0, 5, 3] = torch.nextafter(c._kv[1, 1, 0, 5, 3], torch.tensor(1e9))
    assert shared_prefix.join(c, [a, b]) == 0 and c._kv_group is None
    # Another tenant's identical bytes are not looked at; nor a prefix below MIN_TOKENS.
    assert shared_prefix.join(_req(range(20), kv.clone(), namespace="t2"), [a]) == 0
    assert shared_prefix.join(_req([0, 1, 2, 7, 7], kv.clone()), [a]) == 0
    # A member of a group lends at most what it was checked for: d shares 20 tokens with a,
    # but a is known to match the group only over 12.
    d = _req(range(20), kv.clone())
    assert shared_prefix.join(d, [a]) == 12 and d._kv_group is a._kv_group


def test_each_step_reads_from_the_member_checked_furthest():
    group, other = shared_prefix.Group(), shared_prefix.Group()
    reqs = [SimpleNamespace(_kv_group=grp, _kv_shared=n)
            for grp, n in ((group, 12), (None, 0), (group, 30), (other, 9), (group, 20))]
    plan = [(r, 1) for r in reqs]
    assert shared_prefix.reads(plan) == [(2, 12), None, None, None, (2, 20)]
    assert shared_prefix.reads(plan[:2] + plan[3:4]) is None   # no two members of a group in the step


def _engine(model, tmp_path):
    c = model.config
    cfg = TierConfig(hot_blocks=128, warm_blocks=64, cold_blocks=0, block_tokens=8, device="cpu")
    return Engine(model, TieredCache(cfg, KVLayout(c.num_layers, c.num_kv_heads, c.head_dim)), keep_logits=True,
                  max_batch_tokens=64)


@pytest.mark.parametrize("head_dim", [64, 16])
def test_sessions_behind_one_system_prompt_share_reads_with_the_same_logits(tmp_path, monkeypatch, head_dim):
    """Five sessions behind a 40-token system prompt, admitted behind its first request: they
    join one group, their decode steps read the prompt from one buffer, and every logit of
    every step is the one an engine without shared reads computes."""
    monkeypatch.setattr(shared_prefix, "MIN_TOKENS", 16)
    _kernel(head_dim)
    model = DecoderModel(ModelConfig(num_layers=2, hidden_size=3 * head_dim, num_heads=3, num_kv_heads=1,
                                     head_dim=head_dim, intermediate_size=96, seed=6))
    system = [(7 * i) % 50 + 1 for i in range(40)]
    runs = []
    for share in (True, False):
        eng = _engine(model, tmp_path)
        eng.share_prefixes = share
        eng.generate(system + [60], SamplingParams(max_tokens=1))
        reqs = [eng.submit(EngineRequest(system + [61 + i, 62 + i, 63], SamplingParams(max_tokens=6)))
                for i in range(5)]
        while eng.has_work():
            eng.step()
        runs.append((reqs, dict(eng.stats)))
    (shared_reqs, shared_stats), (plain_reqs, plain_stats) = runs
    assert shared_stats["shared_prefix_joins"] == 4      # the first founds the group, four join it
    assert shared_stats["shared_prefix_reads"] > 0 and plain_stats["shared_prefix_reads"] == 0
    for a, b in zip(shared_reqs, plain_reqs):
        assert a.output == b.output
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
        assert a._kv_group is None   # finished: its buffer went back, and with it what was known of it


def test_extents_name_the_same_slots_however_they_are_cut():
    from cluster.cache.allocator import Extent as E
    assert shared_prefix.same_slots([E(3, 0, 16), E(5, 0, 8)], [E(3, 0, 8), E(3, 8, 8), E(5, 0, 4)]) == 20
    assert shared_prefix.same_slots([E(3, 0, 16)], [E(3, 1, 15)]) == 0
    assert shared_prefix.same_slots([E(3, 0, 16), E(6, 0, 8)], [E(3, 0, 16), E(5, 0, 8)]) == 16
    assert shared_prefix.same_slots([], [E(3, 0, 16)]) == 0


def test_requests_whose_prefixes_were_read_from_the_same_slots_join_without_a_comparison(monkeypatch):
    """The slots' owner holds them locked, so their bytes did not change between the two reads:
    nothing is compared (torch.equal would raise here), and the longest match lends."""
    from cluster.cache.allocator import Extent as E
    monkeypatch.setattr(shared_prefix, "MIN_TOKENS", 4)
    monkeypatch.setattr(shared_prefix.torch, "equal", lambda *a: pytest.fail("compared bytes"))
    kv = torch.zeros(1, 2, 1, 32, 4)
    a = _req(range(20), kv)
    shared_prefix.join(a, [], [E(7, 0, 16), E(9, 0, 4)])
    b = _req(range(24), kv)
    assert shared_prefix.join(b, [a], [E(7, 0, 16), E(9, 0, 8)]) == 20
    assert a._kv_group is b._kv_group and (a._kv_shared, b._kv_shared) == (20, 20)
    c = _req(range(24), kv)   # matches b's slots over 24, but b is known to match the group over 20
    assert shared_prefix.join(c, [a, b], [E(7, 0, 16), E(9, 0, 8)]) == 20
    shared_prefix.forget(c)
    assert (c._kv_group, c._kv_shared, c._kv_source) == (None, 0, ())
