"""The one parse step (``serve_app.parse.parse_generation``): a body becomes the engine's
requests in one call, with prompt ids, sampling parameters, a seed and a session."""

from __future__ import annotations

import pytest

from actors.pytest_plugin import TEST_MODEL
from cluster.engine.checkpoint import ModelSpec, load_tokenizer
from serve_app.errors import APIError
from serve_app.parse import MAX_BATCH_SEQUENCES, Limits, ParseContext, parse_generation


@pytest.fixture(scope="module")
def ctx() -> ParseContext:
    return ParseContext(Limits(), "m", load_tokenizer(ModelSpec.parse(TEST_MODEL)), header_session="from-header")


def test_a_completion_becomes_one_request_with_its_ids_params_seed_and_the_header_session(ctx):
    body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0.5, "seed": 42}
    [gen] = parse_generation(body, False, ctx)
    assert (gen.prompt, gen.params.max_tokens, gen.params.temperature, gen.seed) == ([5, 6, 7], 3, 0.5, 42)
    assert (gen.session_id, gen.batched, gen.prompt_text) == ("from-header", False, None)


def test_the_body_session_wins_and_a_request_without_a_seed_gets_one(ctx):
    [gen] = parse_generation({"model": "m", "prompt": [1, 2], "session_id": "mine"}, False, ctx)
    assert gen.session_id == "mine"
    assert isinstance(gen.seed, int) and 0 <= gen.seed < 2 ** 63


def test_several_prompts_are_several_requests_sharing_one_seed(ctx):
    gens = parse_generation({"model": "m", "prompt": [[1, 2], [3, 4, 5], [6]], "max_tokens": 2}, False, ctx)
    assert [g.prompt for g in gens] == [[1, 2], [3, 4, 5], [6]]
    assert [g.batched for g in gens] == [True, True, True]
    assert len({g.seed for g in gens}) == 1 and gens[0].seed is not None
    assert [g.session_id for g in gens] == ["from-header"] * 3


def test_too_many_sequences_in_one_batch_is_a_400_naming_the_prompt(ctx):
    prompts = [[1]] * (MAX_BATCH_SEQUENCES // 2 + 1)
    with pytest.raises(APIError) as err:
        parse_generation({"model": "m", "prompt": prompts, "n": 2}, False, ctx)
    assert (err.value.status, err.value.param) == (400, "prompt")
    assert f"{len(prompts) * 2} sequences" in str(err.value)


def test_a_chat_becomes_one_request_rendered_with_the_template(ctx):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    [gen] = parse_generation(body, True, ctx)
    expected = ctx.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert (gen.prompt, gen.params.max_tokens, gen.tools, gen.batched) == (expected, 4, None, False)
