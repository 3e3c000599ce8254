"""Paged GQA decode attention (FlashAttention's ``flash_attn_with_kvcache``) over the
per-token-head caches kvgen's stores write: bf16 / fp16, int8, fp8 e4m3 / e5m2 (one fp32 scale
per token and KV head) and int4 levels (one fp16 scale per group of channels)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from kvgen import _dtypes, formats
from kvgen._math import cdiv, next_pow2
from kvgen.codegen.spec import ARCHS, TARGETS, SpecError, VariantSpec, axis

#: the cache formats: "auto" (the queries' dtype, no scales), then kvgen.formats' names
KV_FORMATS = ("auto", formats.INT8.name, formats.FP8_E4M3.name, formats.FP8_E5M2.name, "int4")
INT4_GROUPS = formats.INT4.groups
#: (head_size, head_size_v) pairs the variant lists cover; other sizes generate on demand
HEAD_SIZES = ((128, 128), (64, 64), (80, 80), (96, 96), (192, 128), (256, 256))
# portable: Triton, any arch (gqa_decode.py.j2): a KV head's query rows as the MMA's rows, K and
# V converted to the queries' dtype. rows: a Gluon kernel for sm90 (gqa_decode_rows.py.j2) over
# int8, fp8 (e4m3 and e5m2) and int4 (scale groups of 32, 64 or 128) caches of 128-channel
# heads, rows at
# multiples of 4 bytes (vLLM's 132-byte inline rows too), up to 8 queries a sequence (at most 16
# query rows a KV head): the keys as the MMA's rows; int8 codes multiplied as they are stored (s8
# MMAs), fp8 keys converted to f16 for S and fp8 values multiplied as stored for PV, int4 codes
# looked up as f16 levels (f16 MMAs, a scale group at a time for S); GPU only (Gluon does not run
# in Triton's interpreter).
VARIANTS = ("portable", "rows")
TEMPLATES = {"portable": "gqa_decode.py.j2", "rows": "gqa_decode_rows.py.j2"}
ROWS_ARCHS = ("sm90",)  # warpgroup MMA is Hopper's alone
# what its template generates
ROWS_FORMATS = (formats.INT8.name, formats.FP8_E4M3.name, formats.FP8_E5M2.name, "int4")
ROWS_INT4_GROUPS = (32, 64, 128)  # the int4 scale groups it reads (a K operand a group)
ROWS_MAX_ROWS = 16  # query rows (queries x query heads) a KV head it takes (its MAX_ROWS)
# What kvgen lists, verifies and tunes (and so the op can take, where tuned faster): a form the
# template generates is offered once its tests and sanitizer sections have passed on a GPU
ROWS_OFFERED = ROWS_FORMATS


def inline_row_align(kv: str, group: int, head_size: int = 128) -> int:
    """The ``row_align`` (largest power of two, at most 16, dividing the row pitch in bytes) of
    vLLM's rows with the scales in their pad bytes, for a ``kv`` cache of ``head_size``
    channels: 4 for int8 / fp8 at head 128 (132-byte rows), 8 for int4 at 32 channels a scale
    (64 bytes of codes and four fp16 scales); 16 for a bf16 / fp16 cache (no scales)."""
    from kvgen.families.per_token_head.verify import inline_row

    if kv == "auto":
        return 16
    if kv == "int4":
        _, row = inline_row(cdiv(head_size, 2), cdiv(head_size, group))
    else:
        _, row = inline_row(head_size, None)
    return min(16, row & -row)


def _table_words(values: list[int]) -> tuple[str, ...]:
    """8 byte values (one a magnitude) as a byte permute's two table words, magnitude m in
    byte m % 4 of word m // 4, as PTX hex literals."""
    return tuple(f"0x{sum(v << (8 * i) for i, v in enumerate(values[j : j + 4])):08x}"
                 for j in (0, 4))  # fmt: skip


#: The rows variant's int4 K levels are f16(level / INT4_KEY_MU), one f16 term a level, and
#: INT4_KEY_MU goes on q's unscale factor (exact in fp32: 1128464 / 2^21). Of the multipliers
#: k / 2^21 in [0.5, 1) it is the one whose f16 terms times it come closest to the levels: within
#: 4.6e-5 of each nonzero level, relative (f16 of the levels themselves: 3.9e-4), so that S
#: takes one MMA a scale group instead of two (hi + lo terms).
INT4_KEY_MU = 1128464 / 2**21


def _int4_level_tables() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The int4 levels as byte-permute tables of f16 values (its 8 magnitudes' low bytes, two
    words, then their high bytes, two words): for K, f16(level / INT4_KEY_MU); for V,
    f16(level)."""
    import struct

    levels = formats.per_token_head.INT4_LEVELS

    def f16_bits(x: float) -> int:
        return struct.unpack("<H", struct.pack("<e", x))[0]

    def fp32(x: float) -> float:
        return struct.unpack("<f", struct.pack("<f", x))[0]

    def words(bits: list[int]) -> tuple[str, ...]:
        return _table_words([b & 0xFF for b in bits]) + _table_words([b >> 8 for b in bits])

    k_bits = [f16_bits(fp32(v) / INT4_KEY_MU) for v in levels]
    v_bits = [f16_bits(fp32(v)) for v in levels]
    return words(k_bits), words(v_bits)


def _int4_level_planes() -> tuple[str, ...]:
    """The int4 levels' fp32 bit patterns as byte-permute tables, one plane a byte: for byte
    b = 0..3 of the fp32 level, the two table words of that byte of the 8 magnitudes, planes
    in byte order."""
    import struct

    levels = formats.per_token_head.INT4_LEVELS
    bits = [struct.unpack("<I", struct.pack("<f", v))[0] for v in levels]
    return sum((_table_words([(x >> (8 * b)) & 0xFF for x in bits]) for b in range(4)), ())


def _size_ok(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 16 <= v <= 256 and v % 8 == 0


def sizes_problem(head_size: int, head_size_v: int) -> str | None:
    """Why the decode cannot take these head sizes, in a user's words; None when it can."""
    if _size_ok(head_size) and _size_ok(head_size_v):
        return None
    return (
        f"head_size {head_size} / head_size_v {head_size_v} is not supported: each must be a "
        "multiple of 8 from 16 to 256 (e.g. 64, 80, 96, 128, 192, 256)"
    )


@dataclasses.dataclass(frozen=True)
class GQADecodeSpec(VariantSpec):
    """One GQA decode kernel: head sizes, query dtype, cache format (``kv``) and, for int4,
    channels per scale (``group``; 0 for the other formats)."""

    family: ClassVar[str] = "gqa_decode"
    # flash_attn_with_kvcache takes, of the variants that accept the call, the one whose tuned
    # time is lowest at the bucket (kvgen show marks it) ...
    chosen_by_tuning: ClassVar[str] = "variant"
    # ... compared at these sizes, where every variant is tuned (the rows variant's row_align
    # buckets under 16, vLLM's inline rows, have no portable counterpart: those rows run the
    # variant chosen at row_align 16, at their own bucket's config)
    compared_at: ClassVar[dict[str, int]] = {"row_align": 16}

    head_size: int = axis("d", check=_size_ok, doc="a multiple of 8 from 16 to 256", default=128)
    head_size_v: int = axis("dv", check=_size_ok, doc="a multiple of 8 from 16 to 256", default=128)
    dtype: str = axis("", choices=("bf16", "fp16"), default="bf16")
    kv: str = axis("kv", choices=KV_FORMATS, default="auto")
    group: int = axis("g", choices=(0, *INT4_GROUPS), default=0)
    variant: str = axis("", choices=VARIANTS, default="portable")
    arch: str = axis("", choices=ARCHS, default="sm90")
    target: str = axis("", choices=TARGETS, default="gpu")

    @property
    def template(self) -> str:  # one template (and search space) per algorithm
        return TEMPLATES[self.variant]

    def check_combination(self) -> None:
        if self.variant == "rows":
            if not available("rows", self.arch, self.target):
                raise SpecError(
                    f"{self.family}: the rows variant needs {ROWS_ARCHS} on the GPU (Gluon), not "
                    f"{self.arch}/{self.target}"
                )
            if self.kv not in ROWS_FORMATS or (self.head_size, self.head_size_v) != (128, 128):
                raise SpecError(
                    f"{self.family}: the rows variant reads {ROWS_FORMATS} caches of 128 / 128 "
                    f"heads; got kv={self.kv!r}, {self.head_size} / {self.head_size_v}"
                )
            if self.kv == "int4" and self.group not in ROWS_INT4_GROUPS:
                raise SpecError(
                    f"{self.family}: the rows variant reads int4 caches of {ROWS_INT4_GROUPS} "
                    f"channels a scale; got group={self.group}"
                )
        if (self.kv == "int4") != (self.group != 0):
            raise SpecError(
                f"{self.family}: group (channels per scale) is one of {INT4_GROUPS} for an int4 "
                f"cache and 0 for the others; got kv={self.kv!r}, group={self.group}"
            )

    def derived(self) -> dict[str, Any]:
        d_pad, dv_pad = next_pow2(self.head_size), next_pow2(self.head_size_v)
        if self.kv == "int4":
            # K's codes at least 16 bytes a row: on sm90 the 8-byte rows of a 16-channel head
            # (one [keys, 1, 16] tile of levels) gave wrong scores, wider rows of the same
            # codes (the padding masked) the reference's
            d_pad = max(d_pad, 32)
        out = {
            "torch_dtype": _dtypes.SOURCE[self.dtype],
            "d_pad": d_pad,
            "dv_pad": dv_pad,
            "head_dim_v": self.head_size_v,  # (the combine kernel's name for it)
            # the combine takes every sequence in ``splits`` pieces and masks V's padding columns
            "even_pieces": True,
            "nibble_codes": int(self.kv == "int4"),  # (the space's nibble_tiles)
        }
        if self.kv not in ("auto", "int4"):  # the cache's Triton dtype, from its format
            out["tl_cache_dtype"] = formats.get(self.kv).constants["tl_cache_dtype"]
        if self.kv == "int4":
            # scale groups of the padded head: [groups_pad, channels] tiles
            out["k_tile"] = (cdiv(d_pad, min(self.group, d_pad)), min(self.group, d_pad))
            out["v_tile"] = (cdiv(dv_pad, min(self.group, dv_pad)), min(self.group, dv_pad))
            out["levels"] = [repr(v) for v in formats.per_token_head.INT4_LEVELS]
            out["level_planes"] = _int4_level_planes()
        if self.variant == "rows":
            out["tile"] = 64  # keys a tile: the MMA's M
            if self.kv == "int4":
                out["k_tables"], out["v_tables"] = _int4_level_tables()
                out["k_mu"] = repr(INT4_KEY_MU)
        return out

    def default_meta(self, rows: int, row_align: int = 16) -> dict[str, int]:
        # (row_align: a bucket of the rows variant's tuned configs; the defaults do not vary by it)
        if self.variant == "rows":
            # two 64-key tiles in flight; at least 4 programs an SM, in pieces of at most about
            # 60 tiles: the fastest split of each of the bench's two batches in the H200 sweep
            # (benchmarks/gqa_split_sweep.py: 2 pieces at 128 x 4096, 9 at 8 x 32768)
            return {"num_stages": 2, "split_factor": 4, "piece_tiles": 60}
        # 16 query rows (the MMA's least), 4 warps, 128-key tiles (64 for wider heads) and
        # about eight programs an SM: the fastest points of the H200 sweep at 128 / 128 and 4
        # rows (benchmarks/gqa_decode_sweep.py), two tiles in flight (three for int4), the
        # compiler's register allocation (a cap of 128 measured within 1-5 %).
        wide = self.head_size + self.head_size_v > 256
        stages = 3 if self.kv == "int4" and not wide else 2
        return {
            "block_h": 16,
            "block_n": 64 if wide else 128,
            "num_warps": 4,
            "num_stages": stages,
            "split_factor": 8,
            "max_regs": 0,
        }


def available(variant: str, arch: str, target: str) -> bool:
    """Whether ``variant`` exists for this arch and target (portable: everywhere)."""
    if variant == "rows":
        return arch in ROWS_ARCHS and target == "gpu"
    return True


def spec_for(head_size, head_size_v, dtype, kv, group, arch, target, variant="portable"):
    """The spec, or a ValueError in a user's words."""
    try:
        return GQADecodeSpec(head_size, head_size_v, dtype, kv, group, variant, arch, target)
    except SpecError as e:
        raise ValueError(str(e)) from None
