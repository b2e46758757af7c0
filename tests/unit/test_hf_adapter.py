"""HFCausalLM / HFTokenizer against a tiny random Llama built in the test (no download)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.requirements import require_module  # noqa: E402

transformers = require_module("transformers")

from cluster.engine.hf_adapter import HFTokenizer  # noqa: E402
from cluster.engine.model import CausalLM, DecoderModel, ModelConfig, kv_shape  # noqa: E402
from cluster.engine.tokenizer import Tokenizer  # noqa: E402
from tests.unit.hf_reference import HFCausalLM  # noqa: E402
from tests.unit.reference_forward import forward_batch, forward_one

VOCAB = 300


def tiny_llama_config(**overrides) -> "transformers.LlamaConfig":
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)
    fields.update(overrides)
    return transformers.LlamaConfig(**fields)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hf_model() -> "transformers.LlamaForCausalLM":
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config())
    with torch.no_grad():  # the default init (std 0.02) gives near-constant logits; make them lively
        for param in model.parameters():
            if param.dim() == 2:
                param.mul_(5.0)
    return model.eval()


@pytest.fixture(scope="module")
def adapter(hf_model) -> HFCausalLM:
    return HFCausalLM(hf_model)


def tokens_of(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def test_config_view(adapter: HFCausalLM) -> None:
    assert isinstance(adapter, CausalLM)
    c = adapter.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size, c.max_position, c.dtype) \
        == (2, 4, 2, 16, VOCAB, 256, "float32")


def test_full_prefill_matches_plain_transformers(adapter: HFCausalLM, hf_model) -> None:
    tokens = tokens_of(12, seed=1)
    logits, kv = forward_one(adapter, tokens, 0, None)
    with torch.no_grad():
        reference = hf_model(input_ids=tokens.unsqueeze(0)).logits[0]
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)
    assert kv.shape == kv_shape(adapter.config, 12)


@pytest.mark.parametrize("split", [0, 1, 9, 20, 31])
def test_prefill_with_cached_prefix_equals_full_prefill(adapter: HFCausalLM, split: int) -> None:
    tokens = tokens_of(32, seed=2)
    full_logits, full_kv = forward_one(adapter, tokens, 0, None)
    prefix_kv = forward_one(adapter, tokens[:split], 0, None)[1] if split else None
    logits, kv = forward_one(adapter, tokens[split:], split, prefix_kv)
    torch.testing.assert_close(logits, full_logits[split:], atol=1e-4, rtol=0)
    torch.testing.assert_close(kv, full_kv[:, :, split:], atol=1e-4, rtol=0)


def test_forward_batch_equals_forward_one(adapter: HFCausalLM) -> None:
    history = tokens_of(40, seed=3)
    history_kv = forward_one(adapter, history, 0, None)[1]
    items = [
        (tokens_of(9, seed=4), 0, None),
        (history[15:30], 15, history_kv[:, :, :15]),
        (tokens_of(1, seed=5), 40, history_kv),
    ]
    for item, (logits, kv) in zip(items, forward_batch(adapter, items)):
        one_logits, one_kv = forward_one(adapter, *item)
        torch.testing.assert_close(logits, one_logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(kv, one_kv, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"items\[1\]: past_kv must have shape"):
        forward_batch(adapter, [items[0], (history[15:30], 15, history_kv)])


def test_decoder_model_is_numerically_a_llama() -> None:
    """Our weights loaded into transformers' Llama give our logits and our KV (K after RoPE)."""
    config = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         intermediate_size=96, max_position=256, seed=3)
    ours = DecoderModel(config)
    with torch.no_grad():  # scale up so that the comparison is not between near-zero numbers
        for param in ours.parameters():
            if param.dim() == 2:
                param.mul_(5.0)
    llama = transformers.LlamaForCausalLM(tiny_llama_config(
        vocab_size=config.vocab_size, intermediate_size=96, rms_norm_eps=config.rms_norm_eps)).eval()
    q_rows, kv_rows = 4 * 16, 2 * 16
    with torch.no_grad():
        llama.model.embed_tokens.weight.copy_(ours.embed)
        llama.model.norm.weight.copy_(ours.final_norm)
        llama.lm_head.weight.copy_(ours.lm_head)
        for src, dst in zip(ours.layers, llama.model.layers):
            q, k, v = src.qkv_proj.split([q_rows, kv_rows, kv_rows])
            dst.self_attn.q_proj.weight.copy_(q)
            dst.self_attn.k_proj.weight.copy_(k)
            dst.self_attn.v_proj.weight.copy_(v)
            dst.self_attn.o_proj.weight.copy_(src.o_proj)
            gate, up = src.gate_up_proj.chunk(2)
            dst.mlp.gate_proj.weight.copy_(gate)
            dst.mlp.up_proj.weight.copy_(up)
            dst.mlp.down_proj.weight.copy_(src.down_proj)
            dst.input_layernorm.weight.copy_(src.attn_norm)
            dst.post_attention_layernorm.weight.copy_(src.mlp_norm)
    tokens = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(5))
    our_logits, our_kv = forward_one(ours, tokens[10:], 10, forward_one(ours, tokens[:10])[1])
    hf_logits, hf_kv = HFCausalLM(llama).forward_one(tokens, 0, None)
    assert our_logits.abs().max() > 0.1
    torch.testing.assert_close(our_logits, hf_logits[10:], atol=1e-4, rtol=0)
    torch.testing.assert_close(our_kv, hf_kv[:, :, 10:], atol=1e-4, rtol=0)


def test_from_pretrained_loads_a_local_checkpoint(hf_model, tmp_path: Path) -> None:
    hf_model.save_pretrained(tmp_path)
    loaded = HFCausalLM.from_pretrained(tmp_path)
    tokens = tokens_of(8, seed=6)
    torch.testing.assert_close(forward_one(loaded, tokens)[0], HFCausalLM(hf_model).forward_one(tokens)[0],
                               atol=1e-6, rtol=0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        HFCausalLM.from_pretrained(tmp_path / "missing")


def test_adapter_rejects_non_models_and_bad_inputs(adapter: HFCausalLM) -> None:
    with pytest.raises(TypeError, match="PreTrainedModel"):
        HFCausalLM(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, 300\)"):
        forward_one(adapter, torch.tensor([300]), 0, None)
    with pytest.raises(ValueError, match="past_kv is None but start_pos is 3"):
        forward_one(adapter, torch.tensor([1]), 3, None)


def word_level_tokenizer() -> "transformers.PreTrainedTokenizerFast":
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "hello", "world", "how", "are", "you"]
    raw = RawTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        additional_special_tokens=["<|user|>", "<|assistant|>"], chat_template=template,
    )


def test_hf_tokenizer_adapter() -> None:
    tok = HFTokenizer(word_level_tokenizer())
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (10, 1, 2)
    assert tok.encode("hello world") == [5, 6]
    assert tok.decode([1, 5, 6, 2]) == "hello world"
    assert tok.apply_chat_template([{"role": "user", "content": "how are you"}]) == [1, 3, 7, 8, 9, 4]
    with pytest.raises(TypeError, match="text must be a str"):
        tok.encode(b"hello")
    with pytest.raises(ValueError, match=r"messages\[0\]\['role'\]"):
        tok.apply_chat_template([{"role": "", "content": "hi"}])


def test_the_engine_runs_a_model_without_paged_attention_through_its_leases(adapter: HFCausalLM) -> None:
    """A model without ``forward_paged`` (this adapter) gets its past gathered from the HOT
    pool through the lease and its new KV written back: the engine's tokens are the model's
    own greedy ones, and a second turn finds the first cached (only its suffix computed)."""
    from cluster.cache.kv_pool import KVLayout
    from cluster.cache.tiered import TierConfig, TieredCache
    from cluster.engine.engine import Engine
    from cluster.protocol import SamplingParams

    c = adapter.config
    cache = TieredCache(TierConfig(hot_blocks=32, warm_blocks=0, cold_blocks=0, block_tokens=4, device="cpu"),
                        KVLayout(c.num_layers, c.num_kv_heads, c.head_dim))
    engine = Engine(adapter, cache)
    assert not engine.runner.paged

    def greedy(prompt: list[int], n: int) -> list[int]:
        seq = list(prompt)
        for _ in range(n):
            logits, _ = forward_one(adapter, torch.tensor(seq))
            seq.append(int(torch.argmax(logits[-1])))
        return seq[len(prompt):]

    prompt = tokens_of(20, seed=9).tolist()
    first = engine.generate(prompt, SamplingParams(max_tokens=5))
    assert first.output == greedy(prompt, 5)
    follow = prompt + first.output + [7, 8, 9]
    second = engine.generate(follow, SamplingParams(max_tokens=3))
    assert second.output == greedy(follow, 3)
    assert second.cached_tokens == len(prompt) + len(first.output)   # the first turn, whole (its last token too)
