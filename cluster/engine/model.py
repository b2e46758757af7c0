"""A small Llama-style decoder in pure torch, with an explicit KV contract.

The engine's caches store, for T tokens, one tensor per sequence segment:

    kv[num_layers, 2, T, num_kv_heads, head_dim]   (index 0: K after RoPE, 1: V)

Because K is stored after the rotary embedding of its absolute position, a
cached prefix is reused as is: `forward_paged` of `tokens[p:]` after the slots of `tokens[:p]`
gives the same logits and KV as a full prefill, which is the whole point of a
prefix cache and is what the tests check.

By default the weights are random but deterministic (`ModelConfig.seed`): the
model computes real attention over real KV, so cache hits and misses are checked
for equality, not for meaning. `cluster.engine.checkpoint` loads real Llama,
Mistral, SmolLM and Qwen2/Qwen3 checkpoints into the same packed parameters; the
config flags below (biases, tied embeddings, q/k norm, rope scaling) cover what
those families add to the plain Llama block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from cluster.engine import layer_loop, linear_layouts, packed_weights, paged
from cluster.engine.attention import EXTEND_MAX, EXTEND_MAX_BESIDE_PREFILL  # EXTEND_MAX re-exported: the kernel's reach
from cluster.engine.linear_layouts import linear as _linear
from cluster.engine.model_kernels import ModelKernels
from cluster.engine.model_inputs import (  # noqa: F401  (re-exported: the model's contract)
    BatchItem, CausalLM, CausalLMConfig, kv_shape, validate_item, validate_items, validate_tokens,
)
from cluster.engine.tokenizer import BYTE_VOCAB_SIZE
from cluster.names import DTYPES
INIT_STD = 0.02
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    # The default prefills 2,000 tokens on one CPU thread in about 0.3 s.
    vocab_size: int = BYTE_VOCAB_SIZE
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 688
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position: int = 8192
    seed: int = 0
    dtype: str = "float32"
    # Architecture variants of real checkpoints; the defaults are the plain Llama block.
    tie_word_embeddings: bool = False   # lm_head shares the embedding matrix (SmolLM, small Qwen)
    qkv_bias: bool = False              # Qwen2; Llama/Qwen3 attention_bias sets qkv_bias and o_bias
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False               # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    rope_type: str = "default"          # one of ROPE_TYPES
    rope_factor: float = 1.0            # linear and llama3
    rope_low_freq_factor: float = 1.0   # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_original_max_position: int = 8192  # llama3
    # Rotary angles in float32 exactly as transformers computes them (checkpoint loads set it, so
    # logits match transformers bit for bit); the float64 default is more accurate at far positions.
    rope_in_float32: bool = False

    def __post_init__(self) -> None:
        def check(names: tuple[str, ...], ok, what: str) -> None:
            for name in names:
                if not ok(getattr(self, name)):
                    raise ValueError(f"ModelConfig.{name} must be {what}, got {getattr(self, name)!r}")

        def is_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        check(("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
               "intermediate_size", "max_position", "rope_original_max_position"),
              lambda v: is_int(v) and v > 0, "a positive int")
        check(("rope_theta", "rms_norm_eps", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor"),
              lambda v: (is_int(v) or isinstance(v, float)) and math.isfinite(v) and v > 0,
              "a positive finite number")
        check(("seed",), lambda v: is_int(v) and 0 <= v < 2**63, "an int in [0, 2**63)")
        check(("tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "rope_in_float32"),
              lambda v: isinstance(v, bool), "a bool")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"ModelConfig.head_dim must be even for rotary embeddings, got {self.head_dim}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelConfig.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"ModelConfig.rope_type must be one of {list(ROPE_TYPES)}, got {self.rope_type!r}")
        if self.rope_type == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError(
                f"ModelConfig.rope_high_freq_factor ({self.rope_high_freq_factor}) must exceed "
                f"rope_low_freq_factor ({self.rope_low_freq_factor}) for llama3 rope scaling"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary frequencies [head_dim / 2] with the config's scaling applied, in the order of
    operations of transformers' `_compute_default_rope_parameters`, `_compute_linear_scaling_
    rope_parameters` and `_compute_llama3_parameters` (float64 unless `rope_in_float32`)."""
    dtype = torch.float32 if config.rope_in_float32 else torch.float64
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).to(dtype) / config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    if config.rope_type == "linear":
        inv_freq = inv_freq / config.rope_factor
    elif config.rope_type == "llama3":
        factor, low, high = config.rope_factor, config.rope_low_freq_factor, config.rope_high_freq_factor
        old_context = config.rope_original_max_position
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
        inv_freq = torch.where(medium, blended, scaled)
    return inv_freq


def rope_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_position, head_dim] in float32, rotate-half layout (frequencies twice)."""
    # The table is indexed, never recomputed, so a token gets bit-identical rotations whatever
    # split its sequence was prefilled in.
    inv_freq = rope_inv_freq(config)
    angles = torch.outer(torch.arange(config.max_position, dtype=inv_freq.dtype), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float(), angles.sin().float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim]; cos, sin [N, 1, head_dim] in float32."""
    x32 = x.float()
    return (x32 * cos + _rotate_half(x32) * sin).to(x.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # The order of transformers' LlamaRMSNorm (normalize in float32, cast, then scale), so a
    # checkpoint gives its reference logits in every dtype.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class DecoderLayer(nn.Module):
    """Parameters of one layer; the math lives in DecoderModel so it can pack sequences."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=c.torch_dtype))

        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        # Fused projections: one matmul for q/k/v and one for gate/up (a loader concatenates
        # the separate q, k, v and gate, up matrices of a checkpoint into these).
        self.attn_norm = param(c.hidden_size)
        self.qkv_proj = param(qkv_rows, c.hidden_size)
        self.o_proj = param(c.hidden_size, c.num_heads * c.head_dim)
        self.mlp_norm = param(c.hidden_size)
        self.gate_up_proj = param(2 * c.intermediate_size, c.hidden_size)
        self.down_proj = param(c.hidden_size, c.intermediate_size)
        # Optional parameters come after the plain ones, so the seeded draws of a plain
        # config are the same as before they existed.
        self.qkv_bias = param(qkv_rows) if c.qkv_bias else None
        self.o_bias = param(c.hidden_size) if c.o_bias else None
        self.gate_up_bias = param(2 * c.intermediate_size) if c.mlp_bias else None
        self.down_bias = param(c.hidden_size) if c.mlp_bias else None
        # q_norm (num_heads copies) then k_norm (num_kv_heads copies) of the per-head weight:
        # q and k are normalized together in one call, over their [heads + kv_heads, head_dim] view.
        self.qk_norm = param(c.num_heads + c.num_kv_heads, c.head_dim) if c.qk_norm else None


class DecoderModel(nn.Module):
    """Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

    `init_weights=False` leaves the parameters uninitialized, for a loader that
    overwrites every one of them (see `cluster.engine.checkpoint`).
    """

    def __init__(self, config: ModelConfig | None = None, *, init_weights: bool = True) -> None:
        super().__init__()
        self.config = config = config if config is not None else ModelConfig()
        dtype = config.torch_dtype
        self.embed = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype))
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.final_norm = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype))
        self.lm_head = None if config.tie_word_embeddings else \
            nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype))
        cos, sin = rope_tables(config)   # float32, whatever the model dtype
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # The compiled parts in use (model_kernels): the batched attention and small ops (see
        # use_decode_kernel), the CUDA graphs (use_cuda_graphs), the tuned linear layouts and the
        # weights' packed copies (tune_linears), the compiled layer loop over them.
        self.kernels = ModelKernels()
        # The checkpoint's identity and name, set by its loader: the packed file's key (None: not kept).
        self.weights_id: str | None = None
        self.weights_name = ""
        self.packed_source: dict = {}
        # Where the loader's parameters came from: "checkpoint" (read and cast) or "disk" (this
        # machine's earlier cast, mapped); "" for a model built here.
        self.weights_source = ""
        if init_weights:
            self._init_weights()
        self.eval()
        self.requires_grad_(False)

    def _init_weights(self) -> None:
        # Own generator, float32 draws, fixed registration order: the same seed gives the
        # same weights in every process and for every dtype, and the global RNG is untouched.
        generator = torch.Generator().manual_seed(self.config.seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm"):
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) * INIT_STD)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def output_weight(self) -> torch.Tensor:
        """The lm_head matrix [vocab, hidden] (the embedding when tied)."""
        return self.embed if self.lm_head is None else self.lm_head

    @torch.no_grad()
    def forward_paged(self, items: Sequence[paged.PagedItem], pool: torch.Tensor,
                      last_logits_only: bool = False) -> list[torch.Tensor]:
        """The same forward, reading and writing K/V in place in a slotted KV pool.

        ``pool`` is ``KVPool.tensor``, ``[num_blocks, layers, 2, block_tokens, kv_heads,
        head_dim]``; each item is ``(tokens, start_pos, slots)`` with ``slots`` the pool slot
        (``block * block_tokens + offset``) of each of the sequence's ``start_pos +
        len(tokens)`` positions: the first ``start_pos`` hold the cached prefix's K/V, at the
        rest this forward writes the new tokens' K/V, layer by layer. Attention reads the
        pool through the table (``cluster.engine.paged``): nothing of the past is copied.
        Items may share the slots of a common prefix; a slot written here may be read only
        by a later item or one on the batched kernel (ValueError otherwise). Returns each
        item's logits ([1, vocab] with ``last_logits_only``).
        """
        pool = paged.validate_pool(self.config, pool, self.device)
        checked = paged.validate_items(self.config, items, pool)
        if not checked:
            return []
        reach = EXTEND_MAX_BESIDE_PREFILL if self.kernels.prefill is not None else EXTEND_MAX
        decodes = paged.kernel_items(self.kernels.attention, pool, checked, reach)
        paged.check_writes(checked, decodes.items if decodes is not None else set())
        if self.kernels.graphs is not None:   # CUDA: a step of decodes alone replays a captured graph
            logits = self.kernels.graphs.run(checked, pool)
            if logits is not None:
                return logits
        slot_rows = paged.SlotRows(pool, checked, self.kernels.prefill)

        def attend(layer_index, q, k, v, item_index):
            return slot_rows.attend(self.config, layer_index, q, k, v, item_index)

        return self.forward_packed([(t.to(self.device), p) for t, p, _ in checked], attend, last_logits_only, decodes)

    def use_decode_kernel(self, on: bool = True) -> bool:
        """Attend the items of ``forward_paged`` that follow a prefix with at most
        ``EXTEND_MAX`` new tokens (decodes, later turns) with the compiled kernel over the
        pool's slots (``cluster.engine.kernels``: ``paged_attention``, float32 on the CPU,
        Triton on CUDA); True when it is in use. On the CPU the norms and the rotary
        embedding then run compiled too (one call each instead of five or six ops: at a
        decode step's few rows the dispatch costs more than the arithmetic), and so does a
        prompt chunk's attention where the head_dim is 64 and the CPU has AVX-512
        (``prefill_attention``: one flash pass over the cached prefix and the chunk)."""
        kernels = self.kernels
        kernels.attention, kernels.graphs, kernels.small_ops, kernels.layer_loop = None, None, None, None
        kernels.prefill = None
        if on and self.config.dtype == "float32" and self.device.type == "cpu":
            from cluster.engine.kernels import paged_attention, prefill_attention, small_ops
            self.kernels.attention = paged_attention()
            self.kernels.small_ops = small_ops()
            if paged.prefill_fits(self.config):
                self.kernels.prefill = prefill_attention()
        elif on and self.device.type == "cuda":
            from cluster.engine.kernels import cuda_paged_attention
            self.kernels.attention = cuda_paged_attention()
        self.kernels.layer_loop = layer_loop.compiled_layers(self)
        return self.kernels.attention is not None

    def use_cuda_graphs(self, on: bool = True, sizes: Sequence[int] | None = None) -> bool:
        """On CUDA with the Triton attention in use (``use_decode_kernel``): replay a CUDA
        graph per batch-size bucket for ``forward_paged`` steps of decodes alone
        (``cluster.engine.cuda_graphs``); True when on."""
        self.kernels.graphs = None
        if on and self.device.type == "cuda" and hasattr(self.kernels.attention, "prepare_paged"):
            from cluster.engine.cuda_graphs import DEFAULT_SIZES, DecodeGraphs
            self.kernels.graphs = DecodeGraphs(self, self.kernels.attention, sizes or DEFAULT_SIZES)
        return self.kernels.graphs is not None

    @property
    def graph_stats(self) -> dict[str, int]:
        return dict(self.kernels.graphs.stats) if self.kernels.graphs is not None else {}

    def tune_linears(self) -> dict[str, dict[int, str]]:
        """Use, per row count, the fastest of MKL's linear layouts on this machine
        (``cluster.engine.linear_layouts``: measured once a machine), for the layers'
        linears and for the output head apart; CPU only. The layouts and the weights'
        packed copies come from this machine's packed file when the checkpoint has one
        (``cluster.engine.packed_weights``; ``packed_source`` says which). Returns the
        layout per measured row count of each group."""
        if self.device.type != "cpu":
            return {}
        self.packed_source = packed_weights.tune(self)
        return packed_weights.finish(self)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: int,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        return _linear(x, weight, bias, layout, self.kernels.packed.get((layout, id(weight))), residual)

    def forward_packed(self, checked: list[tuple[torch.Tensor, int]], attend, last_logits_only: bool,
                       decodes: "paged.PagedItems | None" = None) -> list[torch.Tensor]:
        """The packed forward over every item's new tokens (``(tokens, start_pos)`` each, on the
        model's device, checked); ``attend(layer, q, k, v, item)`` stores one item's new K/V where
        it keeps them and returns its attention output. ``decodes``: the items the batched kernel
        attends, all at once per layer. ``forward_paged`` is this over the pool's slot tables;
        the tests' reference forward (``tests/unit/reference_forward.py``) is this over one
        contiguous KV tensor per item."""
        tokens = torch.cat([t for t, _ in checked]) if len(checked) > 1 else checked[0][0]
        positions = torch.cat([torch.arange(p, p + t.numel(), device=self.device) for t, p in checked])
        ends = list(accumulate(t.numel() for t, _ in checked))
        bounds = list(zip([0] + ends[:-1], ends))
        logits, bounds = self.run_layers(tokens, positions, bounds, attend, last_logits_only, decodes)
        return [logits[begin:end] for begin, end in bounds]

    def run_layers(self, tokens: torch.Tensor, positions: torch.Tensor, bounds: list[tuple[int, int]], attend,
                last_logits_only: bool, decodes: "paged.PagedItems | None"
                ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """``_forward`` on the packed tokens and their positions (device tensors; what a CUDA
        graph captures, ``cluster.engine.cuda_graphs``): the logits of all rows kept (the
        last of each item with ``last_logits_only``) and each item's rows in them."""
        c = self.config
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        q_width = c.num_heads * c.head_dim
        kv_width = c.num_kv_heads * c.head_dim

        hidden = self.embed[tokens]
        layout = linear_layouts.layout_for(self.kernels.layer_layouts, hidden.shape[0])   # the fastest for these rows
        norm, rope = _rms_norm, _apply_rope
        if self.kernels.small_ops is not None:
            norm, rope = self.kernels.small_ops.rms_norm, self.kernels.small_ops.rope
        all_on_kernel = decodes is not None and len(decodes.items) == len(bounds)
        loop = self.kernels.layer_loop if all_on_kernel and layout == linear_layouts.BLOCKED else None
        if loop is not None:   # every sequence on the kernel, the linears blocked: the loop in one call (CPU)
            hidden = loop(hidden, cos, sin, decodes)
        python_layers = self.layers if loop is None else ()
        for layer_index, layer in enumerate(python_layers):
            attn_in = norm(hidden, layer.attn_norm, c.rms_norm_eps)
            qkv = self._linear(attn_in, layer.qkv_proj, layer.qkv_bias, layout)
            # q and k side by side as [N, heads + kv_heads, head_dim]: one norm and one rotation.
            qk = qkv[:, :q_width + kv_width].view(-1, c.num_heads + c.num_kv_heads, c.head_dim)
            if layer.qk_norm is not None:
                qk = norm(qk, layer.qk_norm, c.rms_norm_eps)
            qk = rope(qk, cos, sin)
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
            v = qkv[:, q_width + kv_width:].view(-1, c.num_kv_heads, c.head_dim)
            if all_on_kernel:   # no gather
                attn_out = decodes.attend(q, k, v, layer_index, c.head_dim ** -0.5)
            else:
                attn_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
                for item_index, (begin, end) in enumerate(bounds):   # first: the kernel may read their K/V
                    if decodes is not None and item_index in decodes.items:
                        continue
                    attn_out[begin:end] = attend(layer_index, q[begin:end], k[begin:end], v[begin:end], item_index)
                if decodes is not None:
                    rows = decodes.rows
                    attn_out[rows] = decodes.attend(q[rows], k[rows], v[rows], layer_index, c.head_dim ** -0.5)
            hidden = self._linear(attn_out.view(-1, q_width), layer.o_proj, layer.o_bias, layout, residual=hidden)
            mlp_in = norm(hidden, layer.mlp_norm, c.rms_norm_eps)
            gate, up = self._linear(mlp_in, layer.gate_up_proj, layer.gate_up_bias, layout).chunk(2, dim=-1)
            hidden = self._linear(F.silu(gate) * up, layer.down_proj, layer.down_bias, layout, residual=hidden)

        if last_logits_only:
            hidden = hidden[[end - 1 for _, end in bounds]]
            bounds = [(i, i + 1) for i in range(len(bounds))]
        logits = self._linear(norm(hidden, self.final_norm, c.rms_norm_eps), self.output_weight, None,
                              linear_layouts.layout_for(self.kernels.head_layouts, hidden.shape[0])).float()
        return logits, bounds

