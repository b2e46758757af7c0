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


def _checkpoint_copy(tmp_path, edit=None):
    """The default model's tokenizer files in ``tmp_path`` (``edit(name, data)`` changes one's JSON)."""
    import shutil

    from cluster.engine.checkpoint import ModelSpec, resolve_checkpoint
    from tests.requirements import require_default_model

    require_default_model()
    source = resolve_checkpoint(ModelSpec.parse(None))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, tmp_path / name)
    if edit is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            path = tmp_path / name
            data = json.loads(path.read_text()) if path.is_file() else {}
            if edit(name, data):
                path.write_text(json.dumps(data))
    return source, tmp_path


def test_the_grammars_tokenizer_built_from_the_files_is_the_one_transformers_gives(tmp_path):
    from cluster.engine.checkpoint import load_tokenizer
    from cluster.engine.grammar import _ll_tokenizer, ll_tokenizer_from_files

    source, _ = _checkpoint_copy(tmp_path)
    hf = load_tokenizer(None)
    direct, loaded = ll_tokenizer_from_files(source, 49152), _ll_tokenizer(hf, 49152)
    assert direct.eos_tokens == loaded.eos_tokens == list(hf.stop_token_ids)
    assert direct.vocab_size == loaded.vocab_size == 49152
    assert all(direct.decode_bytes([i]) == loaded.decode_bytes([i]) and
               direct.is_special_token(i) == loaded.is_special_token(i) for i in range(49152))
    for text in ("Hello, world!", '{"name": "Ana", "age": 3}', "<|im_start|>user\nhi<|im_end|>", " ünïcode ☃ 日本"):
        assert direct.tokenize_str(text) == loaded.tokenize_str(text)

    def refused(_):
        raise AssertionError("the files say the whole tokenizer: nothing is loaded")
    g = Grammars.deferred(refused, 49152, source)
    m = g.matcher(GrammarSpec("regex", "yes|no"))
    assert set(torch.nonzero(g.mask(m)).flatten().tolist()) == \
        {t for t in range(49152) if loaded.decode_bytes([t]) and b"yes".startswith(loaded.decode_bytes([t]))
         or loaded.decode_bytes([t]) and b"no".startswith(loaded.decode_bytes([t]))}


@pytest.mark.parametrize("case", ["added token only in the config", "two eos tokens", "no eos token",
                                  "generation eos outside the vocabulary"])
def test_files_that_do_not_say_the_whole_tokenizer_fall_back_to_loading_it(tmp_path, case):
    from cluster.engine.grammar import ll_tokenizer_from_files

    def edit(name, data):
        if case == "added token only in the config" and name == "tokenizer_config.json":
            data["added_tokens_decoder"] = {"49151": {"content": "<tool>", "special": True}}
        elif case == "two eos tokens" and name == "special_tokens_map.json":
            data["eos_token"] = "<|endoftext|>"
        elif case == "no eos token" and name == "tokenizer_config.json":
            del data["eos_token"]
        elif case == "generation eos outside the vocabulary" and name == "generation_config.json":
            data["eos_token_id"] = [2, 60000]
        else:
            return False
        return True
    _, directory = _checkpoint_copy(tmp_path, edit)
    assert ll_tokenizer_from_files(directory, 49152) is None
    loads = []
    g = Grammars.deferred(lambda: loads.append(1) or TOK, TOK.vocab_size, directory)
    g.prepare()
    assert loads == [1] and g.ready


def test_padding_and_truncation_in_the_files_are_turned_off_as_transformers_turns_them_off(tmp_path):
    from cluster.engine.grammar import ll_tokenizer_from_files

    def edit(name, data):
        if name != "tokenizer.json":
            return False
        data["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
        data["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
                           "pad_id": 2, "pad_type_id": 0, "pad_token": "<|im_end|>"}
        return True
    source, directory = _checkpoint_copy(tmp_path, edit)
    text = "one two three four five six seven eight nine ten"
    assert ll_tokenizer_from_files(directory, 49152).tokenize_str(text) == \
        ll_tokenizer_from_files(source, 49152).tokenize_str(text)
