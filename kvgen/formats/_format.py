"""The KV-cache formats as data: one ``KVFormat`` object per format, declared once.

A format object says what a cache row of the format is (element type and width, scale type,
how many channels share a scale, where the scales live), gives its pure-torch quantize and
dequantize (the references of ``kvgen/formats/mxfp4.py`` and ``per_token_head.py``), the
constants and Jinja macros the templates write its arithmetic with, and its entries in
``kvgen verify --accuracy``. Families, ops, the verifier and the bench take a format's facts from
here; the byte definitions are in docs/formats.md.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable
from typing import Any

import torch

from kvgen._math import cdiv
from kvgen.formats import mxfp4, per_token_head

#: where a format keeps its scales
OWN_CACHE = "own cache"  # a scale tensor beside the code cache, one entry per (token, head, group)
ROW_TAIL = "row tail"  # after the row's packed codes, in the same cache row


def _fp32(x: float) -> float:
    """``x`` rounded to fp32, as a Python float that converts back to it exactly."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclasses.dataclass(frozen=True)
class Element:
    """How one value is encoded: ``bits`` a value, held in tensors of ``dtype`` (4-bit codes
    two a byte, element 2i in the low nibble)."""

    name: str
    bits: int
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class Scale:
    """How a scale is encoded, and the dtype of a tensor of scales (E8M0 scales are bytes)."""

    name: str
    dtype: torch.dtype


INT8_ELEMENT = Element("int8", 8, torch.int8)
E4M3 = Element("fp8 e4m3", 8, torch.float8_e4m3fn)
E5M2 = Element("fp8 e5m2", 8, torch.float8_e5m2)
INT4_LEVELS = Element("int4, Gaussian-friendly levels (sign + 3-bit magnitude)", 4, torch.uint8)
E2M1 = Element("E2M1 (OCP MX FP4)", 4, torch.uint8)
FP32_SCALE = Scale("fp32", torch.float32)
FP16_SCALE = Scale("fp16", torch.float16)
E8M0 = Scale("e8m0, 2^(X - 127)", torch.uint8)


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """One KV-cache format, from its parts. ``group`` arguments are channels per scale; a
    format whose scale covers a whole (token, head) row has ``groups == ()`` and ignores
    them."""

    name: str  #: the name in variant names and ``kvgen verify --accuracy``
    element: Element
    groups: tuple[int, ...]  #: the channels-per-scale values kvgen generates; () = one per row
    scale: Scale
    scale_placement: str  #: OWN_CACHE or ROW_TAIL
    title: str  #: how tables print it
    default_group: int | None
    #: the Jinja file (in templates/) whose macros write this format's quantize / dequantize
    macros: str
    #: (x [..., width], group) -> (codes [..., code_bytes], scales [..., scales_per_row])
    _quantize: Callable[[torch.Tensor, int | None], tuple[torch.Tensor, torch.Tensor]]
    #: (codes, scales, width, group) -> fp32 [..., width]
    _dequantize: Callable[[torch.Tensor, torch.Tensor, int, int | None], torch.Tensor]
    #: constants the templates need, computed from the format's definition
    constants: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: how ``kvgen verify --accuracy`` labels a group
    group_label: str = "{} ch/scale"

    @property
    def code_dtype(self) -> torch.dtype:
        return self.element.dtype

    @property
    def scale_dtype(self) -> torch.dtype:
        return self.scale.dtype

    @property
    def scale_bytes(self) -> int:
        return self.scale.dtype.itemsize

    def _group(self, group: int | None) -> int | None:
        if not self.groups:
            return None
        group = self.default_group if group is None else group
        if group not in self.groups:
            raise ValueError(f"{self.name}: group must be one of {self.groups}, got {group}")
        return group

    def code_bytes(self, width: int) -> int:
        """Bytes of the packed codes of one row of ``width`` channels."""
        return cdiv(width * self.element.bits, 8)

    def scales_per_row(self, width: int, group: int | None = None) -> int:
        group = self._group(group)
        return 1 if group is None else cdiv(width, group)

    def row_bytes(self, width: int, group: int | None = None) -> int:
        """Bytes of one cache row: the codes, and the scales where they live in the row."""
        tail = self.scales_per_row(width, group) * self.scale_bytes
        return self.code_bytes(width) + (tail if self.scale_placement == ROW_TAIL else 0)

    def quantize(self, x: torch.Tensor, group: int | None = None):
        """``x`` [..., width] -> (codes, scales), byte for byte what the stores write."""
        return self._quantize(x, self._group(group))

    def dequantize(self, codes, scales, width: int, group: int | None = None) -> torch.Tensor:
        return self._dequantize(codes, scales, width, self._group(group))

    def roundtrip(self, x: torch.Tensor, group: int | None = None) -> torch.Tensor:
        """quantize then dequantize: what a reader of the cache gets back for ``x``."""
        return self.dequantize(*self.quantize(x, group), x.shape[-1], group)

    def accuracy_entries(self) -> list[tuple[str, int | None]]:
        """(label, group) of each line this format adds to ``kvgen verify --accuracy``."""
        if not self.groups:
            return [(self.title, None)]
        return [(f"{self.title}, {self.group_label.format(g)}", g) for g in self.groups]


def _scaled(name: str, element: Element, tl_name: str, mant: int, bias: int, min_normal: int):
    """An int8 / fp8 format with one fp32 scale per (token, head) row: amax / QMAX."""
    dtype = element.dtype
    qmax, _ = per_token_head.QUANT_RANGE[dtype]
    constants = {
        "cache_torch_dtype": str(dtype).removeprefix("torch."),
        "tl_cache_dtype": tl_name,
        "qmax": repr(qmax),
        "inv_qmax": repr(_fp32(1.0 / qmax)),  # RN(1 / QMAX) in fp32
        "min_scale": repr(per_token_head.MIN_SCALE),
        # the interpreter's hand encoding of fp8 (its fp32 -> fp8 cast is wrong on carries)
        "mant_bits": mant,
        "exp_bias": bias,
        "min_normal_bits": f"0x{min_normal:X}",
        "fp8_shift": 23 - mant,
        "fp8_round": (1 << (22 - mant)) - 1,
        "fp8_rebias": (127 - bias) << mant,
        "fp8_sub_scale": repr(2.0 ** (bias + mant - 1)),
        "fp8_min_normal": repr(2.0 ** (1 - bias)),
    }
    return KVFormat(
        name,
        element,
        (),
        FP32_SCALE,
        OWN_CACHE,
        title=f"{element.name} per token-head",
        default_group=None,
        macros="_format_scaled.j2",
        _quantize=lambda x, group: per_token_head.quantize_per_token_head(x, dtype),
        _dequantize=lambda q, s, width, group: per_token_head.dequantize_per_token_head(q, s),
        constants=constants,
    )


def int4_midpoint_parts() -> list[tuple[int, float, float]]:
    """Per level boundary: the fp32 boundary B_i (its bits and value) and h_i, half its ulp (a
    power of two). M_i = B_i + h_i is the midpoint between B_i and the next fp32 value up:
    RN_fp32(z) > B_i exactly when z > M_i (a tie rounds to B_i's neighbour of even mantissa, but
    never occurs; see the int4 macros)."""
    out = []
    for b in per_token_head.INT4_BOUNDARIES:
        bits = struct.unpack("<I", struct.pack("<f", b))[0]
        lo = struct.unpack("<f", struct.pack("<I", bits))[0]
        hi = struct.unpack("<f", struct.pack("<I", bits + 1))[0]
        out.append((bits, lo, (hi - lo) / 2))
    return out


def int4_midpoints() -> list[float]:
    """M_i = B_i + h_i, exactly (as Python floats: 25 significant bits fit)."""
    return [b + h for _, b, h in int4_midpoint_parts()]


INT8 = _scaled("int8", INT8_ELEMENT, "int8", 0, 0, 0)
FP8_E4M3 = _scaled("fp8e4m3", E4M3, "float8e4nv", 3, 7, 0x3C800000)
FP8_E5M2 = _scaled("fp8e5m2", E5M2, "float8e5", 2, 15, 0x38800000)

INT4 = KVFormat(
    "int4",
    INT4_LEVELS,
    per_token_head.INT4_CHANNELS,
    FP16_SCALE,
    OWN_CACHE,
    title="int4 levels",
    default_group=per_token_head.INT4_DEFAULT_CHANNELS,
    macros="_format_int4.j2",
    _quantize=lambda x, group: per_token_head.quantize_int4(x, group),
    _dequantize=lambda q, s, width, group: per_token_head.dequantize_int4(q, s, width),
    constants={
        "min_scale": repr(per_token_head.MIN_SCALE),
        "boundaries": [repr(b) for b in per_token_head.INT4_BOUNDARIES],
        "midpoints": [repr(m) for m in int4_midpoints()],
        # (B_i as PTX's hex float literal, h_i): the GPU's fp32 form of the thresholds
        "midpoint_parts": [(f"0f{bits:08X}", repr(h)) for bits, _, h in int4_midpoint_parts()],
    },
)


def _mxfp4_quantize(x: torch.Tensor, group: int):
    rows = mxfp4.quantize_rows(x.reshape(-1, x.shape[-1]), group)
    half = x.shape[-1] // 2
    lead = x.shape[:-1]
    return rows[:, :half].reshape(*lead, half), rows[:, half:].reshape(*lead, -1)


def _mxfp4_dequantize(codes: torch.Tensor, scales: torch.Tensor, width: int, group: int):
    rows = torch.cat([codes.reshape(-1, codes.shape[-1]), scales.reshape(-1, scales.shape[-1])], 1)
    return mxfp4.dequantize_rows(rows, width, group).reshape(*codes.shape[:-1], width)


MXFP4 = KVFormat(
    "mxfp4",
    E2M1,
    (16, 32, 64),
    E8M0,
    ROW_TAIL,
    title="mxfp4",
    default_group=32,
    macros="_format_mxfp4.j2",
    _quantize=_mxfp4_quantize,
    _dequantize=_mxfp4_dequantize,
    group_label="group {}",
)

#: every format, by name
FORMATS: dict[str, KVFormat] = {f.name: f for f in (INT8, FP8_E4M3, FP8_E5M2, INT4, MXFP4)}


def get(name: str) -> KVFormat:
    """The format called ``name``; a ValueError names the known ones."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown KV format {name!r}; known: {', '.join(FORMATS)}") from None
