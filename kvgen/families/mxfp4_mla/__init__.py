"""The MXFP4 MLA latent family: the store (quantize + scatter) and the gather (dequantize)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from kvgen import _dtypes, formats
from kvgen._math import next_pow2
from kvgen.codegen.spec import ARCHS, TARGETS, SpecError, VariantSpec, axis

GROUPS = formats.MXFP4.groups
# The latent widths every variant list covers; any multiple of the group up to 16384 can be
# generated on demand. 448 is there because it is not a power of two.
LATENTS = (256, 448, 512, 1024)
FLOAT_DTYPES = ("bf16", "fp16", "fp32")
LAYOUTS = ("paged", "flat")
ROPES = (16, 32, 64, 128)  # RoPE channels a row with RoPE may carry


def _latent_ok(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 16 <= v <= 16384 and v % 16 == 0


@dataclasses.dataclass(frozen=True)
class _MXFP4Spec(VariantSpec):
    """The MXFP4 specs' axes; ``dtype`` is the store's input and the reader's output dtype,
    which the templates call by that role (``DTYPE_ROLE``: ``in_dtype`` / ``out_dtype``)."""

    DTYPE_ROLE: ClassVar[str]

    group: int = axis("g", choices=GROUPS, default=formats.MXFP4.default_group)
    latent: int = axis("l", check=_latent_ok, doc="a multiple of 16 from 16 to 16384", default=512)
    dtype: str = axis("", choices=FLOAT_DTYPES, default="bf16")
    layout: str = axis("", choices=LAYOUTS, default="paged")
    arch: str = axis("", choices=ARCHS, default="sm90")
    target: str = axis("", choices=TARGETS, default="gpu")

    def check_combination(self) -> None:
        if self.latent % self.group:
            raise SpecError(
                f"{self.family}: group={self.group} does not divide latent={self.latent}"
            )

    def derived(self) -> dict[str, Any]:
        num_groups = self.latent // self.group
        num_groups_pad = next_pow2(num_groups)
        return {
            self.DTYPE_ROLE: self.dtype,
            "torch_dtype": _dtypes.SOURCE[self.dtype],
            "num_groups": num_groups,
            "num_groups_pad": num_groups_pad,
            "half": self.latent // 2,
            "half_pad": num_groups_pad * self.group // 2,
            "row_bytes": formats.MXFP4.row_bytes(self.latent, self.group),
            "format_macros": formats.MXFP4.macros,
        }


@dataclasses.dataclass(frozen=True)
class StoreMXFP4MLASpec(_MXFP4Spec):
    family: ClassVar[str] = "store_mxfp4_mla"
    DTYPE_ROLE: ClassVar[str] = "in_dtype"

    def default_meta(self, num_tokens: int) -> dict[str, int]:
        # Measured on an H200 (benchmarks/results): few tokens want the shortest path per row
        # (one row, 4 warps); many tokens want whole groups per thread (few rows and warps), as
        # the kernel is bound by integer ALU work there. The tuner refines this per arch.
        if num_tokens <= 64:
            return {"rows_per_program": 1, "num_warps": 4, "num_stages": 1}
        rows = 2 if self.dtype == "fp32" else 4
        return {"rows_per_program": rows, "num_warps": 2, "num_stages": 1}


@dataclasses.dataclass(frozen=True)
class _RopeRow:
    """The ``rope`` axis of the MXFP4 rows that carry the RoPE channels as bf16 after the
    scales (2-byte aligned: an even number of scale bytes), for a store or reader spec."""

    rope: int = axis("r", choices=ROPES, default=64)

    def check_combination(self) -> None:
        super().check_combination()
        if (self.latent // self.group) % 2:
            raise SpecError(
                f"{self.family}: the RoPE part's bf16 needs an even number of scale bytes; "
                f"latent={self.latent} / group={self.group} is odd"
            )

    def derived(self) -> dict[str, Any]:
        d = super().derived()
        return d | {"rope": self.rope, "row_bytes": d["row_bytes"] + 2 * self.rope}


@dataclasses.dataclass(frozen=True)
class StoreMXFP4RopeMLASpec(_RopeRow, StoreMXFP4MLASpec):
    """``store_mxfp4_mla`` with ``k_pe``: the latent's MXFP4 row (the rope-free row's bytes),
    then the RoPE channels as bf16 (576 / 512: 400-byte rows); the same template."""

    family: ClassVar[str] = "store_mxfp4_rope_mla"


@dataclasses.dataclass(frozen=True)
class GatherMXFP4MLASpec(_MXFP4Spec):
    family: ClassVar[str] = "gather_mxfp4_mla"
    DTYPE_ROLE: ClassVar[str] = "out_dtype"

    def default_meta(self, num_tokens: int) -> dict[str, int]:
        rows = max(1, min(16, next_pow2(max(1, 4096 // self.latent))))
        return {"rows_per_program": rows, "num_warps": 4, "num_stages": 1}


@dataclasses.dataclass(frozen=True)
class GatherMXFP4RopeMLASpec(_RopeRow, GatherMXFP4MLASpec):
    """``gather_mxfp4_mla(..., rope_dim=)``: the rows ``store_mxfp4_mla(..., k_pe=)`` writes,
    read back as ``[rows, latent + rope]`` (the latent dequantized, the RoPE part exact)."""

    family: ClassVar[str] = "gather_mxfp4_rope_mla"
