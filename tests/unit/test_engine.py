"""The runner on the tiered cache: cached KV gives the logits of a full prefill."""

import pytest
import torch

from cluster.cache.kv_pool import KVLayout
from cluster.cache.radix_tree import COLD, HOT, WARM
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.engine.model import DecoderModel, ModelConfig
from cluster.engine.engine import Engine, EngineRequest, SamplingParams
from cluster.engine.sampling import greedy_tokens
from cluster.engine.plan import ScheduledRequest, StepPlan
from cluster.errors import InvalidInputError
from tests.unit.reference_forward import forward_one

TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return DecoderModel(ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                    intermediate_size=128, seed=3))


def make_engine(model, tmp_path, hot=64, warm=64, cold=64, block_tokens=8, **kw):
    c = model.config
    cfg = TierConfig(hot_blocks=hot, warm_blocks=warm, cold_blocks=cold, block_tokens=block_tokens,
                     disk_dir=str(tmp_path) if cold else None, device="cpu", **kw)
    cache = TieredCache(cfg, KVLayout(c.num_layers, c.num_kv_heads, c.head_dim))
    return Engine(model, cache, keep_logits=True)


def full_logits(model, tokens):
    return forward_one(model, torch.tensor(tokens), 0, None)[0]


def assert_exact(model, req):
    """Every position computed after the cache hit equals a full prefill."""
    tokens = req.prompt + req.output
    ref = full_logits(model, tokens)
    got = torch.cat(req.logits, dim=0)
    start = req.cached_tokens
    assert got.shape[0] == len(req.prompt) - start + len(req.output) - 1
    assert torch.allclose(got, ref[start:start + got.shape[0]], atol=TOL, rtol=0)
    plain = greedy_without_cache(model, req.prompt, len(req.output))
    assert req.output == plain


def greedy_without_cache(model, prompt, n):
    toks = list(prompt)
    for _ in range(n):
        toks.append(int(full_logits(model, toks)[-1].argmax()))
    return toks[len(prompt):]


def test_second_turn_hits_and_matches_full_prefill(model, tmp_path):
    eng = make_engine(model, tmp_path)
    first = eng.generate(list(range(40)), SamplingParams(max_tokens=4))
    assert first.cached_tokens == 0
    assert_exact(model, first)
    follow = eng.generate(first.prompt + first.output + [7, 8, 9], SamplingParams(max_tokens=4))
    assert follow.cached_tokens == 44     # the whole first turn, its output included
    assert_exact(model, follow)
    assert eng.cache.tree.protected_tokens == 0
    eng.cache.check_invariants()


def test_exact_after_a_node_split(model, tmp_path):
    eng = make_engine(model, tmp_path)
    eng.generate(list(range(30)), SamplingParams(max_tokens=2))
    branch = eng.generate(list(range(13)) + [99, 98, 97], SamplingParams(max_tokens=3))
    assert branch.cached_tokens == 13 and eng.cache.tree.stats["splits"] >= 1
    assert_exact(model, branch)


def test_exact_after_copy_on_write(model, tmp_path):
    eng = make_engine(model, tmp_path)
    eng.generate([5] * 3, SamplingParams(max_tokens=1))   # leaves a short slot in an open block
    req = eng.generate([6] * 11, SamplingParams(max_tokens=6))
    assert eng.cache.hot.cow_copies >= 1
    assert_exact(model, req)
    again = eng.generate(req.prompt + req.output + [1], SamplingParams(max_tokens=2))
    assert again.cached_tokens == 17
    assert_exact(model, again)


def test_exact_after_compaction(model, tmp_path):
    eng = make_engine(model, tmp_path)
    reqs = [eng.generate([i] * 2, SamplingParams(max_tokens=1)) for i in range(10, 20)]
    for r in reqs[::2]:
        eng.cache.tree.drop(eng.cache.tree.match_prefix(r.prompt + r.output).last_node)
    moved = eng.cache.hot.compact(8, can_move=lambda n: n is not None and n.lock_ref == 0)
    assert moved >= 1 and eng.cache.hot.moved_tokens > 0
    for r in reqs[1::2]:
        again = eng.generate(r.prompt + r.output + [3], SamplingParams(max_tokens=2))
        assert again.cached_tokens == 3
        assert_exact(model, again)
    eng.cache.check_invariants()


@pytest.mark.parametrize("tier", [WARM, COLD])
def test_exact_after_demotion_and_promotion(model, tmp_path, tier):
    eng = make_engine(model, tmp_path)
    first = eng.generate(list(range(50, 90)), SamplingParams(max_tokens=3))
    sequence = first.prompt + first.output
    # The prompt's node and the reply's, leaf first, one tier at a time (43 tokens per pass).
    assert eng.cache.demote_path(sequence, None, tier) == 43 * tier
    nodes = eng.cache.tree.match_prefix(sequence).nodes
    assert [n.tier for n in nodes] == [tier] * len(nodes)
    follow = eng.generate(sequence + [1, 2], SamplingParams(max_tokens=3))
    assert follow.cached_tokens == 43 and follow.tier_hits[tier] == 43
    assert all(n.tier == HOT for n in nodes)
    assert_exact(model, follow)
    eng.cache.check_invariants()


def test_batched_requests_equal_one_at_a_time(model, tmp_path):
    prompts = [list(range(i, i + 20 + 3 * i)) for i in range(5)]
    solo = [make_engine(model, tmp_path / f"s{i}", cold=0).generate(p, SamplingParams(max_tokens=5)).output
            for i, p in enumerate(prompts)]
    eng = make_engine(model, tmp_path, cold=0)
    reqs = [eng.submit(EngineRequest(p, SamplingParams(max_tokens=5))) for p in prompts]
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
    assert [r.output for r in reqs] == solo
    assert steps == 5   # one step prefills all five prompts together, then four shared decode steps
    for r in reqs:
        assert_exact(model, r)


def test_the_greedy_requests_of_a_step_take_one_argmax_with_the_tokens_of_their_own(model, tmp_path):
    """Plain greedy requests are sampled together (one argmax over their rows), the others
    one by one; every request gets the tokens it gets alone."""
    params = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=6, temperature=0.7, seed=3),
              SamplingParams(max_tokens=6), SamplingParams(max_tokens=6, logprobs=2),
              SamplingParams(max_tokens=6, repetition_penalty=1.3), SamplingParams(max_tokens=6)]
    prompts = [list(range(i + 5, i + 30)) for i in range(len(params))]
    solo = [make_engine(model, tmp_path / f"s{i}", cold=0).generate(pr, pa).output
            for i, (pr, pa) in enumerate(zip(prompts, params))]
    eng = make_engine(model, tmp_path, cold=0)
    reqs = [eng.submit(EngineRequest(pr, pa)) for pr, pa in zip(prompts, params)]
    while eng.has_work():
        eng.step()
    assert [r.output for r in reqs] == solo


def test_batched_greedy_leaves_a_nan_row_to_the_request_own_sampling():
    """The first of equal maxima, as torch.argmax of one row; a row with a NaN gets no
    token here (its own sampling refuses it, failing that request only)."""
    reqs = [EngineRequest([1, 2, 3], SamplingParams(max_tokens=2)) for _ in range(3)]
    for r in reqs:
        r.num_computed_tokens = len(r.tokens) - 1   # one token left to compute: this step samples
    rows = [torch.tensor([[0.0, 2.0, 2.0, 1.0]]), torch.tensor([[0.0, float("nan"), 5.0, 1.0]]),
            torch.tensor([[3.0, -1.0, 3.0, 0.0]])]
    got = greedy_tokens(StepPlan([ScheduledRequest(r, 2, 1) for r in reqs]), rows)
    assert got == {id(reqs[0]): 1, id(reqs[2]): 0}
    assert greedy_tokens(StepPlan([ScheduledRequest(reqs[0], 2, 1)]), rows[:1]) == {}   # one: its own sampling


def test_seeded_sampling_is_reproducible(model, tmp_path):
    eng = make_engine(model, tmp_path, cold=0)
    p = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=11)
    a = eng.generate(list(range(12)), p).output
    b = eng.generate(list(range(12)), p).output
    assert a == b


def test_stop_tokens_and_cancel_release_locks(model, tmp_path):
    eng = make_engine(model, tmp_path, cold=0)
    ref = eng.generate(list(range(25)), SamplingParams(max_tokens=6)).output
    stopped = eng.generate(list(range(25)), SamplingParams(max_tokens=6, stop_token_ids=(ref[2],)))
    assert stopped.output == ref[:3] and stopped.finish_reason == "stop"
    prompt = list(range(25)) + list(range(100, 115))
    req = eng.submit(EngineRequest(prompt, SamplingParams(max_tokens=50)))
    eng.step()
    eng.step()
    assert eng.cache.tree.protected_tokens > 0
    eng.cancel(req)
    assert req.finished and req.finish_reason == "cancelled"
    assert eng.cache.tree.protected_tokens == 0
    # What was computed before the cancel is cached.
    assert len(req.output) == 2
    assert eng.cache.tree.match_prefix(prompt + req.output).length == 42
    eng.cache.check_invariants()


def test_bad_requests_are_rejected(model, tmp_path):
    eng = make_engine(model, tmp_path, cold=0)
    with pytest.raises(InvalidInputError, match="vocab_size"):
        eng.submit(EngineRequest([1, 2, 9999]))
    with pytest.raises(InvalidInputError, match="must not be empty"):
        eng.submit(EngineRequest([]))
    with pytest.raises(InvalidInputError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidInputError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidInputError, match="exceeds the model's context"):
        eng.submit(EngineRequest([1] * 10, SamplingParams(max_tokens=model.config.max_position)))
    assert not eng.has_work()


def test_hf_adapter_reuse_through_the_engine(tmp_path):
    from tests.requirements import require_module

    transformers = require_module("transformers")
    from tests.unit.hf_reference import HFCausalLM

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False)
    hf = HFCausalLM(transformers.LlamaForCausalLM(cfg).eval())
    eng = make_engine(hf, tmp_path)
    first = eng.generate(list(range(30)), SamplingParams(max_tokens=3))
    assert eng.cache.demote_path(first.prompt + first.output, None, WARM) == 33
    follow = eng.generate(first.prompt + first.output + [200, 201], SamplingParams(max_tokens=3))
    assert follow.cached_tokens == 33 and follow.tier_hits[WARM] == 33
    assert_exact(hf, follow)


def test_seeded_sampling_resumes_exactly_from_the_tokens_already_sent(model, tmp_path):
    """A request cut after k tokens and resumed with them appended to its prompt
    (a replica died mid-stream) samples exactly what the first run sampled."""
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    prompt = list(range(10, 50))
    for name in "abc":
        (tmp_path / name).mkdir()
    whole = make_engine(model, tmp_path / "a").generate(prompt, params).output
    k = 5
    rest = make_engine(model, tmp_path / "b").generate(
        prompt + whole[:k], SamplingParams(max_tokens=12 - k, temperature=1.0, top_p=0.9, seed=1234)).output
    assert whole[:k] + rest == whole
    other = make_engine(model, tmp_path / "c").generate(
        prompt, SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1235)).output
    assert other != whole    # the seed matters


def test_deferred_finish_delivers_the_last_token_before_caching_the_sequence(model, tmp_path):
    eng = make_engine(model, tmp_path)
    prompt = list(range(40))
    req = eng.submit(EngineRequest(prompt, SamplingParams(max_tokens=1)))
    events = eng.step(defer_finish=True)
    assert [(e.request, e.token, e.finished) for e in events] == [(req, req.output[0], True)]
    assert req.finished and eng.has_work()
    # The sequence is not cached yet (only its prompt, checkpointed when its prefill ended, for
    # the requests that share it), its lease is still held: the caller delivers first.
    assert eng.cache.lookup(prompt + req.output).length == 40 and eng.cache.tree.protected_tokens == 40
    assert eng.stats["requests_finished"] == 0
    eng.complete_finished()
    assert eng.cache.lookup(prompt + req.output).length == 41   # the final token's KV too
    assert eng.stats["requests_finished"] == 1 and eng.cache.tree.protected_tokens == 0
    assert not eng.has_work()


def test_the_next_step_completes_a_deferred_finish_first(model, tmp_path):
    eng = make_engine(model, tmp_path)
    first = eng.submit(EngineRequest(list(range(40)), SamplingParams(max_tokens=1)))
    eng.step(defer_finish=True)
    second = eng.submit(EngineRequest(list(range(40)) + first.output + [7, 8], SamplingParams(max_tokens=1)))
    eng.step(defer_finish=True)   # completes the first before admitting the second: a full hit
    assert second.cached_tokens == 41 and second.finished
    assert second.scheduled_at <= second.admitted_at <= second.forward_at <= second.first_token_at


def gather_slots(pool, slots: torch.Tensor) -> torch.Tensor:
    """The KV at pool slots ``block * block_tokens + offset``, as ``[layers, 2, T, heads, dim]``."""
    bt = pool.block_tokens
    return pool.tensor[slots // bt, :, :, slots % bt].permute(1, 2, 0, 3, 4)


def test_a_running_request_keeps_its_kv_only_in_its_lease_slots(model, tmp_path):
    """No working copy: after every step the KV of each running request's computed
    positions lies at its lease's slots in the HOT pool, equal to the reference forward's,
    and the slot table ends with the room reserved for nothing (all written)."""
    eng = make_engine(model, tmp_path)
    first = eng.generate(list(range(40)), SamplingParams(max_tokens=3))
    reqs = [eng.submit(EngineRequest(list(range(40)) + first.output + [9, 10], SamplingParams(max_tokens=4))),
            eng.submit(EngineRequest(list(range(200, 230)), SamplingParams(max_tokens=4)))]
    checked = 0
    while eng.has_work():
        eng.step()
        for req in eng.scheduler.running:
            n = req.num_computed_tokens
            slots = req.lease.slots()
            assert slots.numel() == n == req.lease.length
            _, kv = forward_one(model, torch.tensor(req.tokens[:n]))
            assert torch.allclose(gather_slots(eng.cache.hot, slots), kv, atol=1e-5)
            checked += 1
    assert checked >= 4 and not hasattr(eng, "scratch")
    for req in reqs:
        assert_exact(model, req)
        assert req.lease is None
