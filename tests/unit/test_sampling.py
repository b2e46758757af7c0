"""The sampling controls (cluster/engine/sampling.py): each one's exact effect on the
logits or the draw, the default path identical to the plain sampler, logprobs from the
raw logits, prompt logprobs computed once and read back from beside the KV."""

import math

import pytest
import torch

from cluster.cache.kv_pool import KVLayout
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.engine.model import DecoderModel, ModelConfig
from cluster.engine.sampling import sample
from cluster.engine.engine import Engine
from cluster.engine.sampling import process, sample_token, token_logprobs
from cluster.errors import InvalidInputError
from cluster.protocol import SamplingParams
from tests.unit.reference_forward import forward_one

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def logits(seed=0, n=50):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_without_controls_the_draw_is_the_plain_samplers_exactly():
    row = logits()
    for t, p in [(0.0, 1.0), (0.7, 1.0), (1.3, 0.8)]:
        params = SamplingParams(temperature=t, top_p=p, seed=1)
        for s in range(20):
            assert sample_token(row, params, [1, 2], [3], gen(s)) == sample(row, t, p, gen(s))


def test_logit_bias_adds_exactly_and_steers_greedy():
    row = logits(1)
    params = SamplingParams(logit_bias=((7, 100.0), (3, -5.5)))
    out = process(row, params, [], [])
    expect = row.clone()
    expect[7] += 100.0
    expect[3] -= 5.5
    assert torch.equal(out, expect)
    assert sample_token(row, params, [], [], None) == 7


def test_penalties_follow_their_definitions():
    row = logits(2)
    prompt, output = [1, 2, 2], [4, 4, 4, 5]
    freq = process(row, SamplingParams(frequency_penalty=0.5), prompt, output)
    pres = process(row, SamplingParams(presence_penalty=1.5), prompt, output)
    expect_f, expect_p = row.clone(), row.clone()
    expect_f[4] -= 1.5
    expect_f[5] -= 0.5
    expect_p[4] -= 1.5
    expect_p[5] -= 1.5
    assert torch.allclose(freq, expect_f, atol=0, rtol=0) and torch.allclose(pres, expect_p, atol=0, rtol=0)
    rep = process(row, SamplingParams(repetition_penalty=1.3), prompt, output)
    for t in range(50):
        if t in (1, 2, 4, 5):   # seen in prompt or output: positive divided, negative multiplied
            want = row[t] / 1.3 if row[t] > 0 else row[t] * 1.3
        else:
            want = row[t]
        assert math.isclose(float(rep[t]), float(want), rel_tol=1e-6)
    # A resumed request: its last prior_output prompt tokens count as its own output.
    resumed = process(row, SamplingParams(frequency_penalty=0.5, prior_output=2), [1, 4, 4], [4, 5])
    expect = row.clone()
    expect[4] -= 1.5
    expect[5] -= 0.5
    assert torch.equal(resumed, expect)


def test_min_tokens_masks_the_stop_tokens_until_reached():
    row = logits(3)
    row[9] = 50.0   # the stop token would win at once
    params = SamplingParams(stop_token_ids=(9,), min_tokens=3)
    assert sample_token(row, params, [], [1, 2], None) != 9
    assert process(row, params, [], [1, 2])[9] == float("-inf")
    assert sample_token(row, params, [], [1, 2, 3], None) == 9


def test_top_k_and_min_p_cut_the_distribution_exactly():
    row = logits(4)
    top3 = set(torch.topk(row, 3).indices.tolist())
    k_params = SamplingParams(temperature=1.5, top_k=3, seed=0)
    drawn = {sample_token(row, k_params, [], [], gen(s)) for s in range(300)}
    assert drawn <= top3 and len(drawn) == 3
    assert {sample_token(row, SamplingParams(temperature=1.0, top_k=1), [], [], gen(s)) for s in range(50)} == \
        {int(row.argmax())}
    probs = torch.softmax(row, -1)
    allowed = {t for t in range(50) if probs[t] >= 0.2 * probs.max()}
    m_params = SamplingParams(temperature=1.0, min_p=0.2)
    drawn = {sample_token(row, m_params, [], [], gen(s)) for s in range(400)}
    assert drawn <= allowed and len(drawn) == len(allowed)


def test_logprobs_are_the_raw_log_softmax_whatever_the_controls():
    row = logits(5)
    lp, top = token_logprobs(row, 11, 3)
    ref = torch.log_softmax(row, -1)
    assert lp == float(ref[11])
    assert [t for t, _ in top] == torch.topk(ref, 3).indices.tolist()
    assert [v for _, v in top] == torch.topk(ref, 3).values.tolist()


def test_values_are_validated_naming_the_parameter():
    for kw, name in [({"top_k": -1}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"presence_penalty": 3}, "presence"),
                     ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"logprobs": 21}, "logprobs"),
                     ({"logit_bias": ((1, 200.0),)}, "logit_bias"), ({"min_tokens": -2}, "min_tokens")]:
        with pytest.raises(InvalidInputError, match=name):
            SamplingParams(**kw)


@pytest.fixture(scope="module")
def engine_and_model():
    model = DecoderModel(ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                     intermediate_size=128, seed=3))
    c = model.config
    cache = TieredCache(TierConfig(hot_blocks=64, warm_blocks=0, block_tokens=8, device="cpu"),
                        KVLayout(c.num_layers, c.num_kv_heads, c.head_dim))
    return Engine(model, cache), model


def test_prompt_and_token_logprobs_equal_a_full_forward_and_are_kept_beside_the_kv(engine_and_model):
    eng, model = engine_and_model
    prompt = [(i * 7) % 250 + 1 for i in range(37)]
    first = eng.generate(prompt, SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=1))
    ref = torch.log_softmax(forward_one(model, torch.tensor(prompt + first.output), 0, None)[0].float(), -1)
    assert first.cached_tokens == 0 and first.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        lp, top = first.prompt_logprobs[i]
        assert abs(lp - float(ref[i - 1, prompt[i]])) < 1e-5 and len(top) == 5   # five kept for later readers
    for j, (lp, top) in enumerate(first.token_logprobs):
        assert abs(lp - float(ref[len(prompt) - 1 + j, first.output[j]])) < 1e-5 and len(top) == 2
    # A second prompt sharing 32 tokens (4 blocks): their KV and logprobs come from the cache;
    # only the last cached position is computed again (its logits predict token 32).
    second_prompt = prompt[:32] + [9, 9, 9, 9, 9]
    second = eng.generate(second_prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert second.cached_tokens == 31
    ref2 = torch.log_softmax(forward_one(model, torch.tensor(second_prompt), 0, None)[0].float(), -1)
    for i in range(1, len(second_prompt)):
        assert abs(second.prompt_logprobs[i][0] - float(ref2[i - 1, second_prompt[i]])) < 1e-5


def test_extreme_values_never_make_the_draw_fail():
    """A repetition penalty near 0 divides seen logits past float32's range (the fuzz suite
    found it as a 503): the draw still picks a token, one of the seen ones."""
    row = logits(6)
    for t in (0.0, 1e-5, 1.0, 2.0):
        params = SamplingParams(temperature=t, repetition_penalty=1e-300, seed=1, top_p=0.5, min_p=0.9)
        assert sample_token(row, params, [1, 2], [3], gen(0)) in (1, 2, 3) or row[[1, 2, 3]].max() <= 0


def test_the_nucleus_from_the_top_candidates_is_the_whole_sorts_exactly(monkeypatch):
    """``sample`` looks for the nucleus among a top-k of candidates before sorting the whole
    vocabulary: the same generator state gives the same token either way, for peaked and
    flat distributions, nuclei past the first and the second candidate counts, and tokens
    tied across the candidates' edge (those are sorted whole, stably by id)."""
    from cluster.engine import sampling

    vocab = 6000
    rows = [torch.randn(vocab, generator=torch.Generator().manual_seed(s)) * scale
            for s, scale in ((0, 8.0), (1, 3.0), (2, 1.0), (3, 0.2))]
    tied = torch.full((vocab,), -5.0)
    tied[:10] = 4.0
    tied[10:3000] = 0.5   # thousands of equal tokens across the 1,024 and 4,096 edges
    rows.append(tied)
    scattered = torch.randn(vocab, generator=torch.Generator().manual_seed(5))
    scattered[torch.randperm(vocab, generator=torch.Generator().manual_seed(5))[:300]] = 5.0
    rows.append(scattered)   # 300 tokens tied at the top, spread over the ids: a top-k's order is not theirs
    cases = [(row, t, p) for row in rows for t in (0.5, 1.0, 1.7) for p in (0.3, 0.9, 0.95, 0.999)]

    def draws() -> list[int]:
        return [sample(row, t, p, torch.Generator().manual_seed(seed)) for row, t, p in cases for seed in range(3)]

    fast = draws()
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", vocab)   # >= the vocabulary: the whole sort
    monkeypatch.setattr(sampling, "NUCLEUS_WIDE", vocab)
    assert draws() == fast
    # The flat rows' nuclei are wider than 1,024 candidates: both paths were taken.
    probs = torch.softmax(rows[3] / 1.7, -1).sort(descending=True).values
    assert int((torch.cumsum(probs, 0) < 0.95).sum()) > 4096


def test_the_draw_follows_the_distribution_and_never_picks_a_zero():
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0, 0.0]))   # two tokens with probability 0
    generator = torch.Generator().manual_seed(7)
    counts = [0] * 6
    for _ in range(20000):
        counts[sample(row, 1.0, 1.0, generator)] += 1
    assert counts[4] == counts[5] == 0
    for token, p in enumerate((0.5, 0.3, 0.15, 0.05)):
        assert abs(counts[token] / 20000 - p) < 0.015, counts
    # top_p 0.8 keeps tokens 0 and 1 at 0.5 / 0.8 and 0.3 / 0.8.
    kept = [sample(row, 1.0, 0.8, generator) for _ in range(8000)]
    assert set(kept) == {0, 1} and abs(kept.count(0) / 8000 - 0.625) < 0.02


def test_a_draw_at_the_top_of_the_range_or_from_an_infinite_logit_still_picks_a_token(monkeypatch):
    from cluster.engine import sampling

    probs = torch.tensor([0.25, 0.75, 0.0, 0.0])
    monkeypatch.setattr(sampling.torch, "rand", lambda *a, **k: torch.tensor(1.0, dtype=torch.float64))
    assert sampling._draw(probs, None, torch.log(probs)) == 1   # the last token with a probability
    monkeypatch.undo()
    row = torch.tensor([0.0, float("inf"), 1.0])
    assert sample(row, 1.0, 1.0, torch.Generator().manual_seed(0)) == 1
    assert sample(row, 1.0, 0.9, torch.Generator().manual_seed(0)) == 1


def _penalized_by_sets(row, params, prompt, output):
    """The penalties as they were computed before ``Penalties`` (Python sets, indexed writes):
    the reference the kept state must equal bit for bit."""
    out = row.float().clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
        values = out[seen]
        out[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    prior = params.prior_output
    own = (list(prompt[len(prompt) - prior:]) if prior else []) + list(output)
    if (params.frequency_penalty or params.presence_penalty) and own:
        counts: dict[int, int] = {}
        for t in own:
            counts[t] = counts.get(t, 0) + 1
        ids = torch.tensor(list(counts), dtype=torch.long)
        out[ids] -= params.frequency_penalty * torch.tensor(list(counts.values()), dtype=torch.float32) \
            + params.presence_penalty
    return out


@pytest.mark.parametrize("seed", range(4))
def test_the_penalties_kept_across_tokens_equal_a_rebuild_every_token_bit_for_bit(seed):
    """A request's ``Penalties`` follow its output as it grows (one state over 40 tokens),
    and give the same floats as the sets rebuilt every token, for every mix of the three
    penalties, a resumed request's own tokens included; a new output list, or a shorter one,
    rebuilds the state."""
    from cluster.engine.sampling import Penalties

    g = torch.Generator().manual_seed(seed)
    vocab = 300
    prompt = torch.randint(0, vocab, (200,), generator=g).tolist()
    for params in (SamplingParams(repetition_penalty=1.3), SamplingParams(frequency_penalty=0.7),
                   SamplingParams(presence_penalty=-0.4, frequency_penalty=1.1, repetition_penalty=0.8),
                   SamplingParams(frequency_penalty=0.5, presence_penalty=0.5, prior_output=30)):
        state, output = Penalties(), []
        for _ in range(40):
            row = torch.randn(vocab, generator=g) * 4
            kept = process(row, params, prompt, output, penalties=state)
            assert torch.equal(kept, _penalized_by_sets(row, params, prompt, output).nan_to_num(
                nan=float("-inf"), posinf=torch.finfo(torch.float32).max, neginf=float("-inf")))
            assert torch.equal(kept, process(row, params, prompt, output))   # a state built for the call
            output.append(int(torch.randint(0, vocab, (1,), generator=g)))
        prior = min(params.prior_output, len(prompt))
        del output[10:]   # the same list, shorter: the state starts over
        assert torch.equal(process(row, params, prompt, output, penalties=state),
                           process(row, params, prompt, output))
        assert int(state.counts.sum()) == prior + 10
        other = output[:5]   # another list: so does it
        assert torch.equal(process(row, params, prompt, other, penalties=state), process(row, params, prompt, other))
        assert int(state.counts.sum()) == prior + 5
