"""Structured output: the mask a grammar gives and what a constrained engine writes."""

import json

import jsonschema
import pytest
import torch

from cluster.cache.kv_pool import KVLayout
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.engine.grammar import GrammarSpec, Grammars, choice_spec
from cluster.engine.model import DecoderModel, ModelConfig
from cluster.engine.engine import Engine
from cluster.engine.tokenizer import ByteTokenizer
from cluster.errors import InvalidInputError
from cluster.protocol import SamplingParams
from tests.requirements import require_module

require_module("llguidance")

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def grammars():
    return Grammars(TOK, TOK.vocab_size)


def allowed(grammars, matcher) -> set[int]:
    return set(torch.nonzero(grammars.mask(matcher)).flatten().tolist())


def test_a_regex_mask_allows_exactly_the_next_bytes_of_its_language(grammars):
    m = grammars.matcher(GrammarSpec("regex", "a(b|cd)"))
    assert allowed(grammars, m) == {ord("a")}
    assert m.consume_tokens([ord("a")])
    assert allowed(grammars, m) == {ord("b"), ord("c")}
    assert m.consume_tokens([ord("c")])
    assert allowed(grammars, m) == {ord("d")}
    assert m.consume_tokens([ord("d")])
    assert allowed(grammars, m) == {TOK.eos_id}          # complete: only the stop token is left


def test_choices_are_literal_text_not_patterns(grammars):
    m = grammars.matcher(choice_spec(["a.b", "c"]))
    assert allowed(grammars, m) == {ord("a"), ord("c")}
    assert m.consume_tokens([ord("a")])
    assert allowed(grammars, m) == {ord(".")}             # the dot is the character, not any byte


def test_a_bad_grammar_is_refused_naming_the_problem(grammars):
    with pytest.raises(InvalidInputError, match="regex"):
        grammars.matcher(GrammarSpec("regex", "a(b"))
    with pytest.raises(InvalidInputError, match="json schema"):
        GrammarSpec("json_schema", '{"type": "nonsense"}').check()
    with pytest.raises(InvalidInputError, match="kind"):
        GrammarSpec("yaml", "x")


def test_resumed_tokens_advance_the_matcher_or_are_refused(grammars):
    m = grammars.matcher(GrammarSpec("regex", "abc"), consumed=[ord("a"), ord("b")])
    assert allowed(grammars, m) == {ord("c")}
    with pytest.raises(InvalidInputError, match="do not follow"):
        grammars.matcher(GrammarSpec("regex", "abc"), consumed=[ord("x")])


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"},
                                           "tag": {"enum": ["x", "yz"]}},
          "required": ["n", "ok", "tag"], "additionalProperties": False}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_random_model_under_a_json_schema_writes_valid_json(seed):
    # The seeded model's logits are noise: everything it writes that parses is the mask's doing.
    model = DecoderModel(ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                                     intermediate_size=64, seed=seed))
    c = model.config
    cache = TieredCache(TierConfig(hot_blocks=64, warm_blocks=0, block_tokens=8, device="cpu"),
                        KVLayout(c.num_layers, c.num_kv_heads, c.head_dim))
    eng = Engine(model, cache, grammars=Grammars(TOK, c.vocab_size))
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    req = eng.generate(TOK.encode("answer: "), SamplingParams(max_tokens=200, temperature=1.0, seed=seed,
                                                              grammar=spec))
    text = TOK.decode([t for t in req.output if t < 256])
    jsonschema.validate(json.loads(text), SCHEMA)
    assert req.finish_reason.value == "stop"
    # The same engine without a grammar writes noise (the model alone does not produce JSON).
    free = eng.generate(TOK.encode("answer: "), SamplingParams(max_tokens=40, temperature=1.0, seed=seed))
    with pytest.raises(ValueError):
        json.loads(TOK.decode([t for t in free.output if t < 256]))


def test_deferred_grammars_load_their_tokenizer_once_on_first_use():
    loads = []
    g = Grammars.deferred(lambda: loads.append(1) or TOK, TOK.vocab_size)
    assert (g.ready, loads, g.build_s) == (False, [], None)   # nothing built until something needs it
    m = g.matcher(GrammarSpec("regex", "ab"))
    assert g.ready and loads == [1] and g.build_s is not None
    assert allowed(g, m) == {ord("a")}
    g.prepare()
    assert loads == [1]                                         # built once


def test_a_caller_during_a_build_waits_for_it_and_nothing_is_built_twice():
    """One build at a time: two at once loaded the tokenizer through transformers' lazy
    modules from two threads, which failed a constrained request with an AttributeError."""
    import threading

    release, started, loads = threading.Event(), threading.Event(), []

    def load():
        loads.append(threading.current_thread().name)
        started.set()
        release.wait(10)   # the background build: held until released
        return TOK

    g = Grammars.deferred(load, TOK.vocab_size)
    slow = threading.Thread(target=g.prepare, name="background")
    slow.start()
    assert started.wait(10)
    got = []
    caller = threading.Thread(target=lambda: got.append(g.matcher(GrammarSpec("regex", "ab"))), name="request")
    caller.start()
    caller.join(0.5)
    assert caller.is_alive() and not got and not g.ready   # waiting on the build, not building its own
    release.set()
    slow.join(10)
    caller.join(10)
    assert loads == ["background"] and g.ready and allowed(g, got[0]) == {ord("a")}


def test_a_worker_starts_without_its_grammars_and_its_first_constrained_request_builds_them():
    import asyncio

    from cluster.protocol import GenerateRequest
    from tests.unit.helpers import make_worker

    core = make_worker("w-g")
    try:
        assert core.grammars is not None and not core.grammars.ready   # the start waited for none of it
        params = SamplingParams(max_tokens=5, grammar=GrammarSpec("regex", "ab"))

        async def go():
            return [i async for i in core.generate(GenerateRequest(TOK.encode("x"), params))]
        items = asyncio.run(go())
        assert [i.token for i in items] == [ord("a"), ord("b")] and core.grammars.ready   # then the stop token
        assert items[-1].finish_reason.value == "stop"
    finally:
        core.close()
