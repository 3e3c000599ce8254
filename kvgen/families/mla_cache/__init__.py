"""The MLA cache store (vLLM's ``concat_and_cache_mla``): the latent and RoPE parts of each
token into one cache row, in the cache's format (``kvgen.formats.mla_cache``); and its reader
(``gather_mla_cache``), the rows of given slots dequantized."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from kvgen import _dtypes, formats
from kvgen.codegen.spec import ARCHS, TARGETS, SpecError, VariantSpec, axis
from kvgen.families.mxfp4_mla import FLOAT_DTYPES
from kvgen.formats import mla_cache

# kv_cache_dtype values (vLLM's names; "fp8_e4m3" is "fp8")
CACHE_FORMATS = ("auto", "fp8", "fp8_ds_mla")


#: latent widths (kv_lora_rank) and RoPE widths the store generates
LATENTS = tuple(range(128, 2049, 128))
ROPES = (16, 32, 64, 128, 256)


@dataclasses.dataclass(frozen=True)
class ConcatAndCacheMLASpec(VariantSpec):
    family: ClassVar[str] = "concat_and_cache_mla"

    fmt: str = axis("", choices=CACHE_FORMATS, default="fp8_ds_mla")
    latent: int = axis("l", choices=LATENTS, default=512)
    rope: int = axis("r", choices=ROPES, default=64)
    in_dtype: str = axis("", choices=FLOAT_DTYPES, default="bf16")
    arch: str = axis("", choices=ARCHS, default="sm90")
    target: str = axis("", choices=TARGETS, default="gpu")

    def check_combination(self) -> None:
        if self.fmt == "auto" and self.in_dtype == "fp32":
            raise SpecError(f"{self.family}: the auto cache holds 16-bit values, not fp32")

    @property
    def row_bytes(self) -> int:
        if self.fmt == "fp8_ds_mla":
            return mla_cache.ds_mla_row_bytes(self.latent, self.rope)
        width = self.latent + self.rope
        return 2 * width if self.fmt == "auto" else width

    def derived(self) -> dict[str, Any]:
        return {
            "torch_dtype": _dtypes.SOURCE[self.in_dtype],
            "tiles": self.latent // mla_cache.DS_MLA_TILE,
            "row_bytes": self.row_bytes,
            # e4m3fn, for the interpreter's hand encoding (_format_scaled.j2's fp8_bits)
            "format_macros": formats.FP8_E4M3.macros,
            **formats.FP8_E4M3.constants,
        }

    def default_meta(self, num_tokens: int) -> dict[str, int]:
        return {"tokens_per_program": 1 if num_tokens <= 64 else 4, "num_warps": 4}


#: the formats the reader's kernel dequantizes ("auto" rows are the values themselves)
READ_FORMATS = ("fp8", "fp8_ds_mla")


@dataclasses.dataclass(frozen=True)
class GatherMLACacheSpec(VariantSpec):
    """``gather_mla_cache``: the fp8 / fp8_ds_mla rows of given slots as ``[rows, latent +
    rope]`` of ``dtype`` (code * k_scale, or code * the tile's scale and the bf16 RoPE part)."""

    family: ClassVar[str] = "gather_mla_cache"

    fmt: str = axis("", choices=READ_FORMATS, default="fp8_ds_mla")
    latent: int = axis("l", choices=LATENTS, default=512)
    rope: int = axis("r", choices=ROPES, default=64)
    dtype: str = axis("", choices=FLOAT_DTYPES, default="fp32")
    arch: str = axis("", choices=ARCHS, default="sm90")
    target: str = axis("", choices=TARGETS, default="gpu")

    @property
    def row_bytes(self) -> int:
        return ConcatAndCacheMLASpec(self.fmt, self.latent, self.rope).row_bytes

    def derived(self) -> dict[str, Any]:
        return {
            "out_dtype": self.dtype,
            "torch_dtype": _dtypes.SOURCE[self.dtype],
            "tiles": self.latent // mla_cache.DS_MLA_TILE,
            "row_bytes": self.row_bytes,
        }

    def default_meta(self, num_tokens: int) -> dict[str, int]:
        return {"rows_per_program": 1 if num_tokens <= 64 else 4, "num_warps": 4}
