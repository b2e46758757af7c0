"""The engine under memory pressure: no request fails for lack of KV, every one produces
exactly the tokens it would with unlimited memory, and the scheduler's budget, preemption
and promotion rules hold step by step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.cache.kv_pool import KVLayout
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.engine.model import DecoderModel, ModelConfig
from cluster.engine.engine import Engine, EngineRequest, SamplingParams
from cluster.errors import InvalidInputError
from cluster.names import WARM
from cluster.protocol import FinishReason

BT = 4
MODEL = DecoderModel(ModelConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                                 intermediate_size=64, vocab_size=64, seed=11))


def make_engine(hot_blocks, warm_blocks=0, budget=64, max_running=16, **kw):
    c = MODEL.config
    cache = TieredCache(TierConfig(hot_blocks=hot_blocks, warm_blocks=warm_blocks, block_tokens=BT, device="cpu"),
                        KVLayout(c.num_layers, c.num_kv_heads, c.head_dim), vocab_size=c.vocab_size,
                        deterministic_io=True)
    return Engine(MODEL, cache, max_batch_tokens=budget, max_running=max_running, cache_final_token=False, **kw)


def run_all(engine, requests, max_steps=5000):
    reqs = [engine.submit(EngineRequest(list(p), params)) for p, params in requests]
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        assert steps < max_steps, "the engine stopped making progress"
    return reqs


def reference_outputs(requests):
    """What each request produces with memory to spare (alone in a big cache)."""
    out = []
    for prompt, params in requests:
        engine = make_engine(hot_blocks=512, budget=4096)
        out.append(run_all(engine, [(prompt, params)])[0].output)
    return out


def check_drained(engine):
    """Every lease ended: nothing locked, no private KV left, the invariants hold."""
    cache = engine.cache
    cache.check_invariants()
    assert cache.protected_tokens == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting


request_st = st.tuples(
    st.lists(st.integers(0, 63), min_size=1, max_size=40),            # the prompt
    st.integers(1, 12),                                                # max_tokens
    st.one_of(st.none(), st.integers(0, 2 ** 32)),                     # seed: None = greedy
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(request_st, min_size=1, max_size=8), spare_blocks=st.integers(0, 24),
       warm_blocks=st.sampled_from([0, 4, 64]), budget=st.sampled_from([3, 8, 64]),
       shared=st.lists(st.integers(0, 63), max_size=12), repeats=st.lists(st.integers(0, 7), max_size=3))
def test_every_request_completes_with_the_tokens_of_unlimited_memory(requests, spare_blocks, warm_blocks, budget,
                                                                     shared, repeats):
    """Random prompts (some sharing a prefix, some sent twice: repeats wait for a fill or start from it),
    lengths, sampling, budgets and HOT sizes down to one request's worth: nothing fails,
    nothing differs from a run with room to spare."""
    reqs = [(shared + prompt, SamplingParams(max_tokens=n, temperature=0.0 if seed is None else 0.9,
                                             seed=seed)) for prompt, n, seed in requests]
    reqs += [reqs[i % len(reqs)] for i in repeats]
    longest = max(len(p) + params.max_tokens + 1 for p, params in reqs)
    hot_blocks = -(-longest // BT) + 1 + spare_blocks   # one request's worth (and the engine's slack block)
    engine = make_engine(hot_blocks, warm_blocks, budget=budget)
    done = run_all(engine, reqs)
    assert [r.error for r in done] == [None] * len(done)
    assert all(r.finished and r.finish_reason in ("stop", "length") for r in done)
    assert [r.output for r in done] == reference_outputs(reqs)
    check_drained(engine)


def test_a_full_hot_pool_preempts_the_newest_into_warm_and_it_resumes_exactly():
    prompts = [[(7 * i + j) % 64 for j in range(20)] for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=5)
    want = reference_outputs([(p, params) for p in prompts])
    engine = make_engine(hot_blocks=20, warm_blocks=64, budget=64)   # 80 tokens: not all four at once
    done = run_all(engine, [(p, params) for p in prompts])
    assert [r.output for r in done] == want and [r.error for r in done] == [None] * 4
    stats = engine.stats
    # The newest running request went first, then the next newest; the two oldest ran through.
    assert [r.preemptions for r in done] == [0, 0, 1, 1] and stats["preemptions"] == 2
    assert stats["preempted_tokens"] > 0
    # Every token a victim had computed came back from the cache, swapped into WARM and back
    # (some still in HOT), none recomputed.
    resumed = stats["resumed_hot_tokens"] + stats["resumed_warm_tokens"] + stats["resumed_cold_tokens"]
    assert (resumed, stats["recomputed_tokens"]) == (stats["preempted_tokens"], 0)
    assert stats["resumed_warm_tokens"] > 0 and stats["resumed_cold_tokens"] == 0
    assert stats["swap_in_bytes"] == stats["resumed_warm_tokens"] * engine.cache.layout.bytes_per_token()
    check_drained(engine)


def test_swapped_out_kv_is_promoted_back_when_the_victim_resumes():
    """Both start small, then grow past what HOT holds: the newer one is preempted, its
    KV goes down to WARM while the older one finishes, and it resumes from WARM
    (swap-in bytes counted), not from scratch."""
    a, b = [1] * 12, [2] * 12
    params = SamplingParams(max_tokens=20)
    want = reference_outputs([(a, params), (b, params)])
    engine = make_engine(hot_blocks=14, warm_blocks=64, budget=64)   # 56 tokens: 33 each, not 66 together
    done = run_all(engine, [(a, params), (b, params)])
    assert [r.output for r in done] == want
    assert engine.stats["preemptions"] >= 1
    assert engine.stats["resumed_warm_tokens"] > 0 and engine.stats["swap_in_bytes"] > 0
    check_drained(engine)


def test_a_request_that_can_never_fit_is_refused_at_submit_naming_the_limit():
    engine = make_engine(hot_blocks=8)   # 32 tokens, one of them slack
    with pytest.raises(InvalidInputError, match=r"more KV than this worker's HOT cache can hold for one request "
                                                r"\(27 tokens\); shorten the prompt or lower max_tokens"):
        engine.submit(EngineRequest([1] * 20, SamplingParams(max_tokens=10)))
    ok = engine.submit(EngineRequest([1] * 20, SamplingParams(max_tokens=6)))   # 27 tokens: fits alone
    while not ok.finished:
        engine.step()
    assert ok.error is None and len(ok.output) == 6


def test_a_long_prompt_is_prefilled_in_budgeted_chunks_while_decodes_go_on():
    engine = make_engine(hot_blocks=128, budget=8)
    short = engine.submit(EngineRequest([3] * 5, SamplingParams(max_tokens=10)))
    while not short.output:
        engine.step()
    long = engine.submit(EngineRequest(list(range(60)), SamplingParams(max_tokens=2)))
    steps, produced = 0, len(short.output)
    while not long.output:
        engine.step()
        steps += 1
        assert engine.stats["computed_tokens"] > 0
    # 60 prompt tokens through a budget of 8, one of which each step went to the running decode.
    assert steps == -(-60 // 7)
    assert len(short.output) - produced == min(steps, 10 - produced)   # it decoded every step meanwhile
    while engine.has_work():
        engine.step()
    assert long.output == reference_outputs([(list(range(60)), SamplingParams(max_tokens=2))])[0]


def test_a_request_whose_prefix_is_promoted_does_not_hold_up_the_step():
    engine = make_engine(hot_blocks=64, warm_blocks=64, budget=64)
    first = engine.generate([9] * 24, SamplingParams(max_tokens=2))
    engine.cache.demote_path(first.tokens[:-1], None, WARM)
    running = engine.submit(EngineRequest([5] * 6, SamplingParams(max_tokens=8)))
    engine.step()
    assert running.output   # running
    follow = engine.submit(EngineRequest(first.tokens[:-1] + [4, 4], SamplingParams(max_tokens=2)))
    before = len(running.output)
    engine.step()   # the follow-up's prefix is being promoted: the running one decodes meanwhile
    assert len(running.output) == before + 1 and follow in engine.scheduler.waiting
    assert engine.stats["waits_for_promotion"] >= 1
    while engine.has_work():
        engine.step()
    assert follow.cached_tokens == 25 and follow.tier_hits[WARM] == 25   # found in WARM, promoted
    assert follow.error is None


def test_only_the_chunks_reserve_room_and_no_step_exceeds_the_budget():
    engine = make_engine(hot_blocks=256, budget=16)
    reqs = [engine.submit(EngineRequest([i] * (10 + 7 * i), SamplingParams(max_tokens=5))) for i in range(6)]
    computed = 0
    while engine.has_work():
        engine.step()
        step_tokens = engine.stats["computed_tokens"] - computed
        computed = engine.stats["computed_tokens"]
        assert step_tokens <= 16
    assert all(r.error is None and len(r.output) == 5 for r in reqs)
    torch.testing.assert_close(torch.tensor(computed), torch.tensor(sum(10 + 7 * i + 4 for i in range(6))))


def test_a_burst_sharing_a_system_prompt_computes_it_once():
    """Eight requests arrive together with a 64-token prompt in common: the first computes
    it and checkpoints it into the tree when its prefill ends; the others wait that step for
    the checkpoint (the shared-fills policy), then compute only their own 3 tokens. Nothing
    is computed twice and every output is as alone."""
    system = [(5 * i) % 64 for i in range(64)]
    requests = [(system + [i, i + 1, i + 2], SamplingParams(max_tokens=3)) for i in range(8)]
    want = reference_outputs(requests)
    engine = make_engine(hot_blocks=256, budget=256)
    done = run_all(engine, requests)
    assert [r.output for r in done] == want
    assert [r.cached_tokens for r in done] == [0] + [64] * 7
    # Each computed token once: the shared prompt, then 3 + 2 more per request (the prefill's
    # tail and the decodes after the first sampled token).
    assert engine.stats["computed_tokens"] == 64 + 8 * (3 + 2)
    assert engine.stats["waits_for_shared_prefix"] == 7
    assert engine.stats["steps"] == 2 + 2
    check_drained(engine)


def six_requests_after_a_cached_prefix(shared_fills: bool):
    """After a cached 64-token prefix, two 3-token tails three times each, greedy and sampled
    in turn; the outputs checked against each request run alone. Returns the engine, its
    computed tokens and steps before, and the finished requests."""
    system = [(5 * i) % 64 for i in range(64)]
    engine = make_engine(hot_blocks=256, budget=256, shared_fills=shared_fills)
    run_all(engine, [(system + [63], SamplingParams(max_tokens=1))])   # the prefix, cached
    before, steps = engine.stats["computed_tokens"], engine.stats["steps"]
    tails = ([1, 2, 3], [6, 7, 8])
    params = (SamplingParams(max_tokens=3), SamplingParams(max_tokens=3, temperature=0.8, seed=7))
    requests = [(system + tails[i // 3], params[i % 2]) for i in range(6)]
    want = reference_outputs(requests)
    done = run_all(engine, requests)
    assert [r.output for r in done] == want
    return engine, before, steps, done


def test_identical_prompts_compute_their_tail_beyond_the_cache_once():
    """Six requests after a cached 64-token prefix, two prompts three times each (chats
    asking the same first question): less than a block (BT = 4) is new, and only the first
    of each computes it; the other two wait that step for its checkpoint (taken although
    less than a block, since they wait on it) and then compute only their last token.
    The same outputs as alone, sampled or greedy."""
    engine, before, steps, done = six_requests_after_a_cached_prefix(shared_fills=True)
    assert [r.cached_tokens for r in done] == [64, 66, 66, 64, 66, 66]
    # The first of each: its 3 new tokens, then 2 decodes; the others: their last token, 2 decodes.
    assert engine.stats["computed_tokens"] - before == 2 * ((3 + 2) + 2 * (1 + 2))
    assert engine.stats["waits_for_shared_prefix"] == 4
    assert engine.stats["steps"] - steps == 4   # the waiting ones' first tokens one step later
    check_drained(engine)


def test_without_shared_fills_identical_prompts_each_compute_their_own_tail():
    """The same six requests with the policy off (``shared_fills``, a worker setting): no
    request waits for another's fill, each computes its own 3 new tokens, and the outputs
    are the same."""
    engine, before, _, done = six_requests_after_a_cached_prefix(shared_fills=False)
    assert [r.cached_tokens for r in done] == [64] * 6
    assert engine.stats["computed_tokens"] - before == 6 * (3 + 2)
    assert engine.stats["waits_for_shared_prefix"] == 0
    check_drained(engine)


def test_identical_prompts_behind_a_fill_that_end_on_their_first_token_or_want_prompt_logprobs():
    """Identical prompts behind a fill: one with max_tokens=1 and one whose first token is
    a stop token end on their first token (their leases end, nothing stays locked); one
    asking for its prompt's logprobs computes the rows it needs. Every output as alone."""
    system = [(7 * i) % 64 for i in range(40)]
    engine = make_engine(hot_blocks=256, budget=256)
    run_all(engine, [(system + [1], SamplingParams(max_tokens=1))])   # the prefix, cached
    prompt = system + [9, 8, 7]
    first = reference_outputs([(prompt, SamplingParams(max_tokens=4))])[0]
    requests = [(prompt, SamplingParams(max_tokens=4)), (prompt, SamplingParams(max_tokens=1)),
                (prompt, SamplingParams(max_tokens=4, stop_token_ids=(first[0],))),
                (prompt, SamplingParams(max_tokens=2, prompt_logprobs=1))]
    done = run_all(engine, requests)
    assert [r.output for r in done] == [first, first[:1], first[:1], first[:2]]
    assert [r.finish_reason for r in done] == [FinishReason.LENGTH, FinishReason.LENGTH, FinishReason.STOP,
                                               FinishReason.LENGTH]
    assert done[3].prompt_logprobs[-1] is not None and done[3].cached_tokens < len(prompt)
    check_drained(engine)


def test_a_request_one_token_past_the_cache_does_not_wait():
    """With only its last token left to compute beyond the cache, a request has nothing
    to wait for: it goes in the same step as the longer prompt that shares its prefix."""
    system = [(3 * i) % 64 for i in range(32)]
    engine = make_engine(hot_blocks=256, budget=256)
    run_all(engine, [(system + [7], SamplingParams(max_tokens=1))])
    requests = [(system + [1, 2, 3], SamplingParams(max_tokens=2)), (system + [1], SamplingParams(max_tokens=2))]
    done = run_all(engine, requests)
    assert [r.output for r in done] == reference_outputs(requests)
    assert [r.cached_tokens for r in done] == [32, 32]
    assert engine.stats["waits_for_shared_prefix"] == 0
    check_drained(engine)


def test_step_times_are_counted_and_decode_only_steps_apart():
    """A 10-token prompt under a 4-token budget: three prefill chunks (the last one samples
    the first token), then one decode step per further token; the wall time of each is
    summed, decode-only steps apart."""
    engine = make_engine(hot_blocks=16, budget=4)
    done = run_all(engine, [(list(range(10)), SamplingParams(max_tokens=5))])
    stats = engine.stats
    assert len(done[0].output) == 5
    assert (stats["steps"], stats["decode_steps"], stats["decode_rows"]) == (3 + 4, 4, 4)
    assert stats["step_ms"] >= stats["forward_ms"] > 0 and stats["step_ms"] >= stats["decode_step_ms"] > 0
    # Two sequences decoding together: each decode step counts both rows.
    engine = make_engine(hot_blocks=16, budget=64)
    run_all(engine, [(list(range(10)), SamplingParams(max_tokens=4)), (list(range(20, 29)), SamplingParams(max_tokens=4))])
    assert (engine.stats["decode_steps"], engine.stats["decode_rows"]) == (3, 6)


def test_waiting_prefixes_in_warm_do_not_push_each_other_out():
    """Four returning sessions whose prefixes are all in WARM, HOT too small for all of
    them at once: a promotion that must make room starts for the oldest only (the
    rest only into free blocks), so the prefixes do not keep pushing each other back
    out (before, this livelocked), and every request completes with the tokens of
    unlimited memory."""
    prompts = [[(11 * i + j) % 64 for j in range(24)] for i in range(4)]
    params = SamplingParams(max_tokens=4)
    engine = make_engine(hot_blocks=22, warm_blocks=64, budget=64)   # 88 tokens: two sessions' worth
    firsts = [engine.generate(p, params) for p in prompts]
    for first in firsts:
        engine.cache.demote_path(first.tokens[:-1], None, WARM)
    engine.cache.wait_all()
    engine.cache.poll()
    follow = [(first.tokens[:-1] + [3, 3], params) for first in firsts]
    before = dict(engine.cache.stats)
    done = run_all(engine, follow)
    assert [r.error for r in done] == [None] * 4
    assert [r.output for r in done] == reference_outputs(follow)
    promoted = engine.cache.stats["promoted_tokens"] - before["promoted_tokens"]
    assert [r.tier_hits[WARM] for r in done] == [27] * 4
    assert 4 * 27 <= promoted <= 2 * 4 * 27   # each prefix up once, or twice at most
    check_drained(engine)


def test_time_slicing_gives_a_waiting_request_the_room_of_a_long_decode():
    """HOT holds one of two 40-token sessions and its answer; A decodes 30 tokens, B
    arrives behind it and finds no room. Without time slicing B waits for all of A's
    answer; with ``time_slice_s`` (a step is one tick of this clock) A yields once it has
    decoded a slice, here 8 measured steps (longer than the 3 s asked for), and B's short
    answer is worth it (its 5 steps against A's 21 left): its KV goes to WARM, B gets its
    first token long before A ends, A resumes from WARM with nothing recomputed, and
    both answers are the ones of unlimited memory."""
    a = [(3 * i) % 64 for i in range(40)]
    b = [(5 * i + 1) % 64 for i in range(40)]
    requests = [(a, SamplingParams(max_tokens=30)), (b, SamplingParams(max_tokens=4))]
    want = reference_outputs(requests)
    firsts = {}
    for time_slice in (None, 3.0):
        now = [0.0]
        engine = make_engine(hot_blocks=20, warm_blocks=64, budget=64,   # 80 tokens: one session and its answer
                             time_slice_s=time_slice, clock=lambda: now[0])
        ra = engine.submit(EngineRequest(list(a), SamplingParams(max_tokens=30)))
        engine.step()   # A alone: its prefill and first token
        rb = engine.submit(EngineRequest(list(b), SamplingParams(max_tokens=4)))
        steps = 0
        while engine.has_work():
            now[0] += 1.0
            engine.step()
            steps += 1
            assert steps < 500
        assert [ra.output, rb.output] == want
        assert ra.error is None and rb.error is None
        firsts[time_slice] = (rb.first_token_at, ra.preemptions, engine.stats["time_slice_preemptions"],
                              engine.stats["recomputed_tokens"])
        check_drained(engine)
    assert firsts[None][1:3] == (0, 0) and firsts[3.0][1:3] == (1, 1)   # A yielded once
    assert firsts[3.0][3] == 0   # A found all it had computed
    # B's first token: after all of A's 29 further decodes without slicing; with it, once 8 step
    # intervals are measured (the forwards at ticks 0-8) and A has run max(3 s, 8 x 1 s).
    assert (firsts[None][0], firsts[3.0][0]) == (30.0, 9.0)
