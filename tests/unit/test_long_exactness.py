"""Exactness at 1,000+ tokens: the real default model (SmolLM2-135M-Instruct) through the
compiled CPU kernels against transformers' own forward, cold, with a cached prefix and on a
later turn (``lab.bench.exactness``, which the GPU check runs on CUDA).

The compiled path is forced, not left to this machine's timing: the blocked linear is made
the fastest layout at every row count (``linear_layouts`` measures per machine and would
otherwise choose), so every step whose sequences all run on the batched attention kernel
runs the compiled layer loop. The calls of each compiled part are counted.
"""

import pytest
import torch

from cluster.engine import kernels, linear_layouts
from cluster.engine.attention import EXTEND_MAX_BESIDE_PREFILL
from cluster.engine.checkpoint import ModelSpec, load_model, load_tokenizer
from lab.bench.exactness import compare, make_engine, make_prompts, package_text
from tests.requirements import require_default_model, require_kernel, require_module

PROMPT, SHARED, LATER, MAX_TOKENS = 1100, 900, 16, 8


@pytest.fixture
def blocked_everywhere(monkeypatch, tmp_path):
    """The blocked layout timed fastest at every row count, in a fresh tuning directory."""
    monkeypatch.setenv(linear_layouts.TUNING_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(linear_layouts, "_known", {})
    monkeypatch.setattr(linear_layouts, "_time", lambda weights, rows, layout, packs, **_:
                        -1.0 if layout == linear_layouts.BLOCKED else float(layout))


@pytest.mark.slow
def test_long_prompts_equal_transformers_through_the_compiled_kernels(blocked_everywhere):
    require_default_model()
    transformers = require_module("transformers")
    for built, name in ((kernels.paged_attention(), "decode_attention"), (kernels.blocked_linear(), "blocked_linear"),
                        (kernels.decoder_layers_paged(), "layers")):
        require_kernel(built, name)
    loaded = load_model(ModelSpec.parse(None))
    model = loaded.model
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(loaded.checkpoint_dir), dtype=torch.float32, local_files_only=True).eval()
    prompts = make_prompts(load_tokenizer(loaded).encode(package_text()), PROMPT, SHARED, LATER)
    assert (len(prompts.first), len(prompts.cached), prompts.cached[:SHARED]) == (PROMPT, PROMPT, prompts.first[:SHARED])
    assert prompts.cached[SHARED] != prompts.first[SHARED]

    engine = make_engine(model, torch.device("cpu"), 2 * PROMPT + LATER + 3 * MAX_TOKENS, 16, 512)
    assert engine.decode_kernel and model.kernels.small_ops is not None
    blocked = linear_layouts.BLOCKED in model.kernels.layer_layouts   # False only where MKL's order is not found here
    assert (model.kernels.layer_loop is not None) == blocked

    result = compare(engine, hf_model, prompts, MAX_TOKENS)
    cases = result["cases"]
    # Cold; a hit on exactly the shared tokens; the later turn finds the whole first turn.
    first_turn = PROMPT + MAX_TOKENS
    assert [(c["prompt_tokens"], c["cached_tokens"]) for c in cases.values()] == \
        [(PROMPT, 0), (PROMPT, SHARED), (first_turn + LATER, first_turn)]
    assert [c["positions"] for c in cases.values()] == \
        [PROMPT + MAX_TOKENS - 1, PROMPT - SHARED + MAX_TOKENS - 1, LATER + MAX_TOKENS - 1]
    for name, case in cases.items():
        assert case["max_abs_diff"] <= 1e-4, (name, case)
        assert case["greedy_agree"] == case["greedy_tokens"] == MAX_TOKENS, (name, case)

    calls = result["kernel_calls"]
    assert calls["extend_attention"] == calls["paged_attention"]   # the JSON's old key: the paged kernel's count
    decode_steps = 3 * (MAX_TOKENS - 1)   # after each request's first token, one step a token, alone
    assert calls["small_ops"] > 0   # the prefill chunks' norms and rotary embedding
    if model.kernels.prefill is not None:
        # AVX-512: each layer of the cold prompt's 3 chunks, the cached one's and the later turn's
        # 16 tokens (past EXTEND_MAX_BESIDE_PREFILL: the prefill kernel takes them)
        assert LATER > EXTEND_MAX_BESIDE_PREFILL
        assert calls["prefill_attention"] == (3 + 1 + 1) * model.config.num_layers
        steps_on_kernel = decode_steps
    else:   # the later turn's 16 tokens on the extend kernel too
        steps_on_kernel = decode_steps + 1
    if blocked:   # every decode step in one compiled call
        assert calls["layer_loop"] >= steps_on_kernel
    else:         # the Python loop, the batched kernel in each layer of those steps
        assert calls["paged_attention"] >= steps_on_kernel * model.config.num_layers
    engine.cache.check_invariants()
