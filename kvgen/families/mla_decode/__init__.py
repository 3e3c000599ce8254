"""MLA decode attention (FlashMLA's API) over a paged bf16/fp16 latent cache."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from kvgen import _dtypes, formats
from kvgen.codegen.spec import ARCHS, TARGETS, SpecError, VariantSpec, axis
from kvgen.formats.mla_cache import ds_mla_row_bytes, mxfp4_rope_row_bytes
from kvgen.space import ARCH_LIMITS

WIDTHS = ((576, 512), (512, 512), (288, 256))
# The split-KV schedule's unit: get_mla_metadata cuts sequences into blocks of this many
# tokens, and the decode kernels walk those blocks.
SCHED_BLOCK = 64
WGMMA_ARCHS = ("sm90",)  # warpgroup MMA is Hopper's alone (sm100 has tcgen05 instead)
# portable: Triton, any arch (mla_decode.py.j2). wgmma: a Gluon kernel, 64-row tiles with the work
# split by roles between warpgroups (mla_decode_wgmma.py.j2; GPU only: Gluon does not run in
# Triton's interpreter). rows: a Gluon kernel for sm90 over fp8_ds_mla (one query of at most 32
# heads a sequence) or MXFP4 (group 32; at most 16 heads) caches, the keys as the MMAs' rows and
# the heads their N (mla_decode_rows.py.j2, mla_decode_rows_mxfp4.py.j2; GPU only).
VARIANTS = ("portable", "wgmma", "rows")
TEMPLATES = {
    "portable": "mla_decode.py.j2",
    "wgmma": "mla_decode_wgmma.py.j2",
    "rows": "mla_decode_rows.py.j2",
}
ROWS_FORMATS = ("fp8_ds_mla", "mxfp4")  # the caches the rows templates read
# What kvgen lists, verifies and tunes (and so the op can take, where tuned faster): a form the
# templates generate is offered once its tests and sanitizer sections have passed on a GPU.
ROWS_OFFERED: tuple[str, ...] = ROWS_FORMATS


def variants_for(kv_format: str) -> tuple[str, ...]:
    """The variants kvgen offers for caches of ``kv_format`` (rows: ROWS_OFFERED's formats)."""
    return tuple(v for v in VARIANTS if v != "rows" or kv_format in ROWS_OFFERED)


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _dim_ok(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 16 <= v <= 1024


def widths_problem(head_dim: int, head_dim_v: int) -> str | None:
    """Why the decode cannot take these widths, in a user's words; None when it can."""
    rope = head_dim - head_dim_v
    if _dim_ok(head_dim) and _pow2(head_dim_v) and head_dim_v >= 16 and (rope == 0 or _pow2(rope)):
        return None
    return (
        f"head_dim {head_dim} / head_dim_v {head_dim_v} is not supported: the decode takes "
        "head_dim_v (the latent, also V) a power of two from 16 to 1024 and head_dim - "
        "head_dim_v (the RoPE part) 0 or a power of two, head_dim at most 1024 "
        f"(e.g. {', '.join(f'{d}/{dv}' for d, dv in WIDTHS)})"
    )


@dataclasses.dataclass(frozen=True)
class MLADecodeSpec(VariantSpec):
    family: ClassVar[str] = "mla_decode"
    # flash_mla_with_kvcache takes, of the variants that accept the cache, the one whose tuned
    # time is lowest at the bucket (kvgen show marks it).
    chosen_by_tuning: ClassVar[str] = "variant"

    head_dim: int = axis("d", check=_dim_ok, doc="an int from 16 to 1024", default=576)
    head_dim_v: int = axis("dv", check=_dim_ok, doc="an int from 16 to 1024", default=512)
    dtype: str = axis("", choices=("bf16", "fp16"), default="bf16")
    variant: str = axis("", choices=VARIANTS, default="portable")
    arch: str = axis("", choices=ARCHS, default="sm90")
    target: str = axis("", choices=TARGETS, default="gpu")

    @property
    def rope(self) -> int:
        return self.head_dim - self.head_dim_v

    @property
    def template(self) -> str:  # one template (and search space) per algorithm
        return TEMPLATES[self.variant]

    def check_combination(self) -> None:
        if not available(self.variant, self.arch, self.target):
            raise SpecError(
                f"{self.family}: the {self.variant} variant needs {WGMMA_ARCHS} on the GPU "
                f"(Gluon), not {self.arch}/{self.target}"
            )
        why = widths_problem(self.head_dim, self.head_dim_v)
        if why:
            raise SpecError(f"{self.family}: {why}")
        fmt = self.derived()["kv_format"]
        if self.variant == "rows" and fmt not in ROWS_FORMATS:
            raise SpecError(
                f"{self.family}: the rows variant reads {ROWS_FORMATS} caches, not {fmt!r}"
            )

    def derived(self) -> dict[str, Any]:
        return {
            "torch_dtype": _dtypes.SOURCE[self.dtype],
            "rope": self.head_dim - self.head_dim_v,
            "sched_block": SCHED_BLOCK,
            # the portable kernel's latent channels in one chunk
            "chunk": self.head_dim_v,
            "nchunk": 1,
            "gl_dtype": _dtypes.SOURCE[self.dtype],
            "kv_format": "auto",  # the cache holds the queries' dtype
            "nibble_codes": 0,  # 1: 4-bit codes, two a byte (the space's nibble_tiles)
            # bytes of a cache row the wgmma loader stages before dequantizing (0: none, the
            # tiles are copied as they are)
            "staged_row_bytes": 0,
        }

    def rows_derived(self, row_bytes: int) -> dict[str, Any]:
        """What the rows templates take beyond ``derived``: rows of ``row_bytes`` bytes."""
        return {
            "tile": SCHED_BLOCK,  # keys a tile = the page the kernel takes
            "row_bytes": row_bytes,
            "dv_pad": self.head_dim_v,
            # the combine takes every sequence in ``splits`` pieces
            "even_pieces": True,
        }

    def default_meta(self, rows: int) -> dict[str, int]:
        if self.variant == "rows":
            # two pages in flight; about 4 programs an SM, pieces of at most 16 pages (the
            # experiment's fastest at 128 x 4096 was two pieces a sequence, 32 pages each)
            return {"num_stages": 2, "split_factor": 4, "piece_tiles": 16}
        if self.variant == "wgmma" and self.derived()["kv_format"] != "auto":
            # 32-key tiles: two bf16 K buffers beside the loader's two staging buffers fit
            # the shared memory; 64-key ones do not
            return {"block_n": 32, "num_stages": 2, "split_factor": 1}
        if self.variant == "wgmma":  # 64-key tiles, two in flight (the fastest point of the
            # H200 sweep at 32-128 heads)
            return {"block_n": 64, "num_stages": 2, "split_factor": 1}
        # 16 query rows x 32 keys with 4 warps: no register spills for 576/512 on sm90 (64-row
        # wgmma tiles spill; the tuner measures whether they pay off anyway).
        block_n = 32
        # Two K tiles in flight where shared memory holds them.
        tile = block_n * self.head_dim * 2
        stages = 2 if 2 * tile <= ARCH_LIMITS[self.arch]["smem_bytes"] else 1
        return {
            "block_h": 16,
            "block_n": block_n,
            "num_warps": 4,
            "num_stages": stages,
            "split_factor": 2 if rows <= 32 else 1,
            "page_ahead": 0,
        }


def available(variant: str, arch: str, target: str) -> bool:
    """Whether ``variant`` exists for this arch and target (portable: everywhere)."""
    if variant in ("wgmma", "rows"):  # (Gluon on warpgroup MMAs)
        return arch in WGMMA_ARCHS and target == "gpu"
    return True


@dataclasses.dataclass(frozen=True)
class MLADecodeDSMLASpec(MLADecodeSpec):
    """The decode over the 656-byte fp8_ds_mla cache (docs/formats.md): DeepSeek's 576 / 512
    with bf16 queries; K and V are dequantized on chip (exact in bf16), never written back.
    Portable and wgmma (the loader partition dequantizes, _mla_decode_wgmma.j2)."""

    family: ClassVar[str] = "mla_decode_fp8_ds_mla"

    def check_combination(self) -> None:
        super().check_combination()
        if (self.head_dim, self.head_dim_v, self.dtype) != (576, 512, "bf16"):
            raise SpecError(f"{self.family}: the fp8_ds_mla record is 576 / 512 with bf16 queries")

    def derived(self) -> dict[str, Any]:
        # chunks of 128 latent channels: one fp32 scale each
        out = super().derived() | {
            "kv_format": "fp8_ds_mla",
            "chunk": 128,
            "nchunk": 4,
            "staged_row_bytes": ds_mla_row_bytes(self.head_dim_v, self.rope),
        }
        if self.variant == "rows":
            out |= self.rows_derived(ds_mla_row_bytes(self.head_dim_v, self.rope))
        return out


@dataclasses.dataclass(frozen=True)
class MLADecodeFP8Spec(MLADecodeSpec):
    """The decode over a per-tensor fp8 cache (e4m3fn codes of every channel, one fp32 k_scale
    for the tensor): K and V dequantized on chip and rounded to the queries' dtype once.
    Portable and wgmma (the loader partition dequantizes)."""

    family: ClassVar[str] = "mla_decode_fp8"

    def derived(self) -> dict[str, Any]:
        return super().derived() | {"kv_format": "fp8", "staged_row_bytes": self.head_dim}


@dataclasses.dataclass(frozen=True)
class MLADecodeMXFP4Spec(MLADecodeSpec):
    """The decode over MXFP4 rows (docs/formats.md): the latent's E2M1 codes and E8M0 scales
    (one per ``group`` channels: 16, 32 or 64), then the RoPE part as bf16 (576 / 512 with
    group 32: 400-byte rows) or none (512 / 512: the seed's rows, 272 bytes with group 32). K
    and V are dequantized on chip (exact in bf16). Portable, and wgmma for bf16 queries (the
    loader partition dequantizes)."""

    family: ClassVar[str] = "mla_decode_mxfp4"

    group: int = axis("g", choices=formats.MXFP4.groups, default=formats.MXFP4.default_group)

    @property
    def template(self) -> str:
        return "mla_decode_rows_mxfp4.py.j2" if self.variant == "rows" else super().template

    def check_combination(self) -> None:
        super().check_combination()
        if (self.head_dim, self.head_dim_v) not in ((576, 512), (512, 512)):
            raise SpecError(f"{self.family}: MXFP4 rows are 576 / 512 or 512 / 512")
        if self.variant == "wgmma" and self.dtype != "bf16":
            raise SpecError(
                f"{self.family}: the wgmma variant reads MXFP4 rows for bf16 queries (fp16: "
                "the portable variant)"
            )
        if self.variant == "rows" and (self.dtype, self.group) != ("bf16", 32):
            raise SpecError(
                f"{self.family}: the rows variant reads MXFP4 rows of group 32 for bf16 queries"
            )

    def derived(self) -> dict[str, Any]:
        chunks = self.head_dim_v // 128  # 128 latent channels: 64 code bytes, 128 / g scales
        row_bytes = mxfp4_rope_row_bytes(self.head_dim_v, self.group, self.rope)
        out = super().derived() | {
            "kv_format": "mxfp4",
            "nibble_codes": 1,
            "chunk": 128,
            "nchunk": chunks,
            "mxfp4_group": self.group,
            "staged_row_bytes": row_bytes,
        }
        if self.variant == "rows":
            out |= self.rows_derived(row_bytes)
        return out
