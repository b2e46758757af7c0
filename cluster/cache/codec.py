"""TierCodec: how WARM, COLD and L3 store KV (``tier_codec: none | int8 | fp8``).

HOT holds KV in the model's dtype, as attention reads it. Below HOT a block
may be stored compressed: each (token, layer, K/V, head) row of ``head_dim``
values becomes ``head_dim`` one-byte codes and one byte of scale, so the
stored pool keeps the block-first layout with a last dimension of
``head_dim + 1`` bytes (``int8``):

    [num_blocks, num_layers, 2, block_tokens, num_kv_heads, head_dim + 1]  int8

- ``int8``: ``q = round(y / s)`` in [-127, 127];
- ``fp8``: ``y / s`` as float8 e4m3 (the byte's bits);

where ``y = x @ R`` is the row turned by a fixed Hadamard rotation ``R`` (the
Sylvester matrix of +-1 entries, block-diagonal in blocks of the largest power
of two dividing ``head_dim``; ``R @ R = b * I`` for block size ``b``) and the
row is restored as ``x ~= (q @ R) * s / b``. The rotation spreads a row's
outlier channels (a key's few large RoPE channels) over the whole block, so the
row's one scale fits all its values far more tightly (QuaRot's and SpinQuant's
observation): the model's next-token logprobs after a promoted prefix move
about half as much as without it. The decode is exact arithmetic up to its
last multiply: ``q @ R`` sums integers (below 2**24 for ``b`` up to 2**17), so
every device and every BLAS blocking gives the same bits.

The scale byte is a logarithmic code ``c`` with ``s = 2 ** (c / 8)``: the
smallest such step at or above ``amax(y) / qmax`` (so nothing clips; a row that
lands a rounding error above a step keeps that step), one byte
where a float16 scale would take two (what lets the stored bytes reach a
quarter of float32's and a half of bfloat16's). A row's scale is its own
(per token and head): a slotted pool writes and moves single tokens (slots,
copy-on-write, compaction), so a scale shared by a block's tokens would be
rewritten by every slot written into it, and one outlier token (an attention
sink) would coarsen its neighbours.

The stored format has a version (``FORMAT_VERSION``, in ``TierCodec.format_id``:
``int8v2``), which L3's key carries: bytes of an older format (version 1 had no
rotation and the same shape) are never looked up, so never misread.

Every conversion happens where a copy between a HOT view and a stored view
happens (``copy_kv``): on the copy thread, on the CUDA copy stream, on the
disk thread and on L3's I/O threads; never on the engine thread. Stored
bytes move between stored tiers as they are (WARM -> COLD, COLD/L3 -> staging),
so checksums cover exactly what is stored, and two formats never meet: a
stored tensor of another format is refused (``CodecMismatchError``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.errors import InvalidInputError

CODECS = ("none", "int8", "fp8")
FORMAT_VERSION = 2         # 1: no rotation; 2: rows Hadamard-rotated before quantizing
SCALE_STEPS = 8            # scale codes per octave: s = 2 ** (code / SCALE_STEPS)
_QMAX = {"int8": 127.0, "fp8": 448.0}
# A row whose rotated amax is a float rounding error above a scale step (a row this codec
# stored, decoded and encoded again) keeps that step instead of taking the next one;
# its largest code is then at most 2 ** (_CEIL_SLACK / SCALE_STEPS) above qmax and clamped.
_CEIL_SLACK = 1e-3


class CodecMismatchError(InvalidInputError):
    """KV stored in one tier codec was handed to a reader of another."""


def check_codec_name(name: object) -> str:
    if name not in CODECS:
        raise InvalidInputError(f"tier_codec must be one of {', '.join(CODECS)}; got {name!r}")
    return name   # type: ignore[return-value]


def format_id(name: str) -> str:
    """What names a codec's stored format where bytes outlive the process (L3's key)."""
    check_codec_name(name)
    return name if name == "none" else f"{name}v{FORMAT_VERSION}"


def fp8_supported(device: torch.device) -> bool:
    """float8 e4m3 conversions run on the device (CUDA, compute capability 8.9 and up)."""
    if device.type != "cuda" or not hasattr(torch, "float8_e4m3fn"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


@dataclass(frozen=True)
class TierCodec:
    """One tier codec for one model dtype and head size."""

    name: str
    model_dtype: torch.dtype
    head_dim: int

    def __post_init__(self) -> None:
        check_codec_name(self.name)
        if not isinstance(self.head_dim, int) or self.head_dim <= 0:
            raise InvalidInputError(f"head_dim must be a positive integer, got {self.head_dim!r}")

    @property
    def compressed(self) -> bool:
        return self.name != "none"

    @property
    def stored_dtype(self) -> torch.dtype:
        return torch.int8 if self.compressed else self.model_dtype

    @property
    def stored_row(self) -> int:
        """The last dimension of a stored tensor: head_dim codes and a scale byte."""
        return self.head_dim + 1 if self.compressed else self.head_dim

    def stored_bytes_per_value_row(self) -> int:
        return self.stored_row * (1 if self.compressed else self.model_dtype.itemsize)

    def is_stored(self, t: torch.Tensor) -> bool:
        return t.dtype == self.stored_dtype and t.shape[-1] == self.stored_row

    def check_stored(self, t: torch.Tensor, what: str = "KV") -> None:
        """Refuse a tensor that is not this codec's stored format (another codec's bytes)."""
        if not self.is_stored(t):
            raise CodecMismatchError(
                f"{what} is {_describe(t)}, not tier codec {self.name!r}'s stored format "
                f"({self.stored_dtype}, last dimension {self.stored_row}): tiers of different "
                f"codecs never share bytes")

    @property
    def format_id(self) -> str:
        return format_id(self.name)

    @property
    def rotation_block(self) -> int:
        """The Hadamard block size ``b``: the largest power of two dividing ``head_dim``."""
        return self.head_dim & -self.head_dim

    # ------------------------------------------------------------- conversions
    def encode_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Write ``x`` (model values, ``[..., head_dim]``) into ``out`` (stored, ``[..., head_dim + 1]``)."""
        d = self.head_dim
        y = torch.matmul(x.float(), rotation(d, x.device))   # a new float32 tensor: scaled in place below
        amax = y.abs().amax(dim=-1, keepdim=True)
        code = torch.log2(amax.div_(_QMAX[self.name])).mul_(SCALE_STEPS).sub_(_CEIL_SLACK).ceil_().clamp_(-128, 127)
        y.div_(_scales(code.device)[code.long().add_(128)])
        if self.name == "int8":
            out[..., :d].copy_(y.round_().clamp_(-127, 127))
        else:
            out[..., :d].copy_(y.clamp_(-448, 448).to(torch.float8_e4m3fn).view(torch.int8))
        out[..., d:].copy_(code)

    def decode_into(self, out: torch.Tensor, s: torch.Tensor) -> None:
        """Write stored ``s`` (``[..., head_dim + 1]``) into ``out`` (model dtype, ``[..., head_dim]``):
        ``(q @ R) * s / b``, the integer product written into ``out`` where it is float32 and
        contiguous, then the row scales multiplied in place (no model-sized temporary)."""
        d = self.head_dim
        rows = s.reshape(-1, d + 1)
        scale = _scales(s.device, self.rotation_block)[rows[:, d].long().add_(128)].unsqueeze(1)
        if out.dtype == torch.float32 and out.is_contiguous():
            flat = out.view(-1, d)
            self._rotated_codes(rows, flat)
            flat.mul_(scale)
        else:
            out.copy_(self._rotated_codes(rows, None).float().mul_(scale).view(out.shape))

    def _rotated_codes(self, rows: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """``q @ R`` of stored rows ``[n, head_dim + 1]`` (into ``out`` if given): exact integers,
        from the CPU's int8 matrix product into int32 (VNNI/AMX: several times faster than a
        float32 one) or a float32 one elsewhere."""
        d = self.head_dim
        if self.name == "int8":
            if rows.device.type == "cpu" and _int_mm_works():
                prod = torch._int_mm(rows[:, :d], rotation(d, rows.device, torch.int8))
                return out.copy_(prod) if out is not None else prod
            q = rows.float()[:, :d]   # all d + 1 columns: a contiguous conversion, far faster than a strided one
        else:
            q = rows[:, :d].contiguous().view(torch.float8_e4m3fn).float()
        return torch.matmul(q, rotation(d, rows.device), out=out)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((*x.shape[:-1], self.stored_row), dtype=self.stored_dtype, device=x.device)
        self.copy_kv(out, x)
        return out

    def decode(self, s: torch.Tensor) -> torch.Tensor:
        out = torch.empty((*s.shape[:-1], self.head_dim), dtype=self.model_dtype, device=s.device)
        self.copy_kv(out, s)
        return out

    def copy_kv(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
        """``dst <- src`` where either side is a model-dtype view or a stored view (or both
        the same format): a plain copy, an encode or a decode. Across devices the
        conversion runs on the CUDA side, on the current stream (the copy stream), so
        only the stored bytes cross the bus."""
        if dst.dtype == src.dtype and dst.shape[-1] == src.shape[-1]:
            dst.copy_(src, non_blocking=non_blocking)
            return
        if not self.compressed:
            raise CodecMismatchError(f"tier codec 'none' cannot convert {_describe(src)} into {_describe(dst)}")
        if src.shape[-1] == self.head_dim and src.is_floating_point():
            self.check_stored(dst, "the destination")
            self._encode_across(dst, src, non_blocking)
        else:
            self.check_stored(src, "the source")
            if dst.shape[-1] != self.head_dim or not dst.is_floating_point():
                raise CodecMismatchError(f"cannot decode into {_describe(dst)}")
            self._decode_across(dst, src, non_blocking)

    def _encode_across(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        if dst.device == src.device:
            for d, s in _chunks(dst, src):
                self.encode_into(d, s)
            return
        tmp = torch.empty((*src.shape[:-1], self.stored_row), dtype=self.stored_dtype, device=src.device)
        self.encode_into(tmp, src)
        dst.copy_(tmp, non_blocking=non_blocking)
        _keep_for_stream(tmp)

    def _decode_across(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        if dst.device == src.device:
            for d, s in _chunks(dst, src):
                self.decode_into(d, s)
            return
        tmp = src.to(dst.device, non_blocking=non_blocking)
        self.decode_into(dst, tmp)
        _keep_for_stream(tmp)


_SCALES: dict[tuple[torch.device, int], torch.Tensor] = {}
_ROTATIONS: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}


def _scales(device: torch.device, divisor: int = 1) -> torch.Tensor:
    """The 256 scales a code byte names (index ``code + 128``), divided by ``divisor`` (a
    power of two: exact), computed once in float64: a table gives every device and every
    kernel path the same bits (``exp2`` may differ in its last bit between vectorized and
    scalar paths)."""
    table = _SCALES.get((device, divisor))
    if table is None:
        codes = torch.arange(-128, 128, dtype=torch.float64)
        table = _SCALES[(device, divisor)] = (torch.exp2(codes / SCALE_STEPS) / divisor).to(torch.float32).to(device)
    return table


def rotation(head_dim: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``R``: the ``head_dim x head_dim`` block-diagonal Sylvester-Hadamard matrix of +-1
    entries (blocks of the largest power of two dividing ``head_dim``).
    ``R @ R = b * I``: the same matrix turns a row and turns it back."""
    key = (head_dim, device, dtype)
    r = _ROTATIONS.get(key)
    if r is None:
        b = head_dim & -head_dim
        h = torch.ones(1, 1)
        while h.shape[0] < b:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        r = _ROTATIONS[key] = torch.block_diag(*[h] * (head_dim // b)).to(device=device, dtype=dtype)
    return r


_INT_MM: list[bool] = []


def _int_mm_works() -> bool:
    """Whether this torch multiplies int8 matrices into int32 on the CPU (``torch._int_mm``;
    checked once, on the shapes it will see: a row stride of ``head_dim + 1``)."""
    if not _INT_MM:
        try:
            a = torch.tensor([[1, -2, 3, 0, 9]], dtype=torch.int8)[:, :4]
            ok = torch.equal(torch._int_mm(a, rotation(4, torch.device("cpu"), torch.int8)),
                             torch.tensor([[2, 6, -4, 0]], dtype=torch.int32))
        except (AttributeError, RuntimeError, NotImplementedError):
            ok = False
        _INT_MM.append(ok)
    return _INT_MM[0]


def scale_of(code: torch.Tensor) -> torch.Tensor:
    """The scales of stored code bytes (for tests and figures)."""
    return _scales(code.device)[code.long() + 128]


def make_codec(name: str, model_dtype: torch.dtype, head_dim: int) -> TierCodec:
    return TierCodec(check_codec_name(name), model_dtype, head_dim)


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} with last dimension {t.shape[-1] if t.dim() else '-'}"


def _chunks(dst: torch.Tensor, src: torch.Tensor):
    """A run of whole blocks converts a block at a time: each block's temporaries stay
    in the CPU's caches instead of streaming through DRAM once per operation."""
    if dst.dim() == 6 and dst.shape[0] > 1 and dst.device.type == "cpu":
        return zip(dst, src)
    return ((dst, src),)


def _keep_for_stream(t: torch.Tensor) -> None:
    """A temporary used by work queued on the current CUDA stream must not be reused
    before that work runs (the caching allocator knows the stream it was made on)."""
    if t.is_cuda:
        t.record_stream(torch.cuda.current_stream(t.device))


def tier_codec(config, layout, device: torch.device) -> TierCodec | None:
    """The codec a cache's lower tiers use (``TierConfig.tier_codec``); None without KV payload."""
    if layout is None:
        return None
    if config.tier_codec == "fp8" and not fp8_supported(device):
        raise InvalidInputError("tier_codec fp8 needs a CUDA device of compute capability 8.9 or later "
                                f"(this cache's device is {device}); use int8")
    return make_codec(config.tier_codec, layout.torch_dtype, layout.head_dim)


def stored_block_bytes(codec: TierCodec | None, layout, config) -> int:
    """Bytes of one stored block below HOT (what ``warm_mb``/``cold_mb`` are divided by)."""
    if layout is None:
        if config.warm_mb is not None or config.cold_mb is not None or config.kv_memory_mb is not None:
            raise InvalidInputError("warm_mb/cold_mb/kv_memory_mb need a KV layout (a cache without KV payload "
                                    "counts blocks)")
        return 1
    row = codec.stored_bytes_per_value_row() if codec is not None else layout.head_dim * layout.torch_dtype.itemsize
    return layout.num_layers * 2 * config.block_tokens * layout.num_kv_heads * row
