import json

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """The models in tests are tiny: extra threads only add spin-wait stalls on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def needs_nixl() -> None:
    """NIXL with a UCX backend: the test fails without it under CI and skips elsewhere."""
    from tests.requirements import require_nixl

    require_nixl()


@pytest.fixture
def vllm_venv(tmp_path):
    """A fake vLLM scratch venv (an empty python) and a tiny Llama config: what bench serving's
    peer command is built from. Returns (the venv's python, the model directory)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    (venv / "bin" / "python").write_text("")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6}))
    return venv / "bin" / "python", model
