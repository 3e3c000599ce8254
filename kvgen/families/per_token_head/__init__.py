"""Per-token-head KV stores: int8 / fp8 (one fp32 scale per token and head) and int4 with
Gaussian-friendly levels (one fp16 scale per group of channels)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from kvgen import _dtypes, formats
from kvgen._math import cdiv, next_pow2
from kvgen.codegen.spec import ARCHS, TARGETS, VariantSpec, axis
from kvgen.families.mxfp4_mla import FLOAT_DTYPES

INT4_CHANNELS = formats.INT4.groups

# Archs whose PTX has packed bf16x2 compares and adds (set / add .bf16x2: sm_90 and up).
PACKED_COMPARE_ARCHS = ("sm90", "sm100")
# Per input dtype, the packed type and, in both lanes of a word, the bias (128.0 / 1024.0:
# their ulp is 1, so bias + code keeps the code in the low mantissa bits) and the sign's
# weight 8.0, for the int4 template's packed count.
PACKED_HALF = {
    "bf16": {
        "h2": "bf16x2",
        "h2_bias": "128.0",
        "h2_bias_bits": "0x43004300",
        "h2_eight_bits": "0x41004100",
    },
    "fp16": {
        "h2": "f16x2",
        "h2_bias": "1024.0",
        "h2_bias_bits": "0x64006400",
        "h2_eight_bits": "0x48004800",
    },
}


def _packed_half(in_dtype: str) -> dict[str, str]:
    """PACKED_HALF's entry, with the constant of the int4 template's byte pack: n >> 12 brings
    the low lane's bias bits (bias >> 12) into bits 0-3, and the pack subtracts them."""
    bias = int(PACKED_HALF[in_dtype]["h2_bias_bits"], 16) & 0xFFFF
    return {**PACKED_HALF[in_dtype], "h2_pack_bits": f"0x{-(bias >> 12) & 0xFFFFFFFF:08X}"}


# the formats of the int8 / fp8 store (kvgen.formats), one fp32 scale per (token, head)
FORMATS = (formats.INT8.name, formats.FP8_E4M3.name, formats.FP8_E5M2.name)
# (head_size, head_size_v) pairs every variant list covers; other sizes generate on demand.
HEAD_SIZES = ((64, 64), (80, 80), (96, 96), (128, 128), (192, 128), (256, 256), (576, 512))


def pieces(width: int, most: int = 4, min_tile: int = 16) -> list[tuple[int, int, int]]:
    """A head of ``width`` channels (or scale groups) as power-of-two tiles ``(offset, tile,
    valid)``: the binary decomposition (576 = 512 + 64, 80 = 64 + 16), with what is left after
    ``most - 1`` tiles, or below ``min_tile``, in one masked tile. Padding 576 to 1024 would
    waste 44 % of the lanes.
    """
    out, off = [], 0
    while width - off >= min_tile and len(out) < most - 1:
        tile = 1 << ((width - off).bit_length() - 1)
        out.append((off, tile, tile))
        off += tile
    if off < width:
        out.append((off, next_pow2(width - off), width - off))
    return out


def equal_pieces(width: int, least: int = 64, most: int = 16) -> list[tuple[int, int, int]]:
    """A head as equal power-of-two tiles where its width allows (576 = 9 x 64, 192 = 3 x 64:
    tiles of at least ``least`` channels, at most ``most`` of them), else ``pieces(width)``.

    Tiles of one size share one register layout, so the kernel takes their elementwise maximum
    and reduces it once; tiles of different sizes (512 + 64) get different layouts, and the
    compiler moved the wide tile through shared memory to meet the narrow one (on sm90: four
    layout conversions a program for 1 x 576 with 512 + 64 tiles).
    """
    tile = width & -width  # the largest power of two dividing width
    if tile >= least and width // tile <= most:
        return [(off, tile, tile) for off in range(0, width, tile)]
    return pieces(width)


def kv_pieces(head_size: int, head_size_v: int) -> tuple[list, list]:
    """K's and V's tiles (``equal_pieces``), V's cut to K's tile where K has one tile size that
    divides V's width (576 / 512: nine and eight tiles of 64, not 512 in one): tiles of one
    size share one register layout, so K's and V's quantization need no layout conversion
    between them."""
    k, v = equal_pieces(head_size), equal_pieces(head_size_v)
    tiles = {tile for _, tile, _ in k}
    if len(tiles) == 1 and len(v) == 1 and head_size_v % min(tiles) == 0:
        tile = min(tiles)
        v = [(off, tile, tile) for off in range(0, head_size_v, tile)]
    return k, v


def pieces_text(tiles: list[tuple[int, int, int]]) -> str:
    """Tiles' widths for a docstring: "9 x 64", "64 + 16", "128"."""
    widths = [tile for _, tile, _ in tiles]
    if len(widths) > 1 and len(set(widths)) == 1:
        return f"{len(widths)} x {widths[0]}"
    return " + ".join(map(str, widths))


def amax_groups(tiles: list[tuple[int, int, int]]) -> list[list[int]]:
    """Indices of the tiles of each size, in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for i, (_, tile, _) in enumerate(tiles):
        groups.setdefault(tile, []).append(i)
    return list(groups.values())


def int4_channels_for(head_size: int, groups: int) -> int | None:
    """Channels per scale that give ``groups`` scales per head (the smallest such: when several
    do, they all make a single group, so the bytes are the same)."""
    return next((c for c in INT4_CHANNELS if cdiv(head_size, c) == groups), None)


def spec_format(spec: VariantSpec) -> tuple[formats.KVFormat, int | None]:
    """The format a per-token-head store spec writes, and its channels per scale."""
    if isinstance(spec, StoreKVInt4Spec):
        return formats.INT4, spec.channels
    return formats.get(spec.fmt), None


def row_align(*caches) -> int:
    """The largest power of two, at most 16, dividing every one of ``caches``' address and
    row strides (all but the last, unit stride) in bytes: the tuned configs' ``row_align``
    bucket. 16 for caches of their own, 4 for vLLM's int8 / fp8 rows with the scale in 4 pad
    bytes (132 bytes at head 128)."""
    bits = 16  # (an OR of the values: its lowest set bit is their common power of two)
    for c in caches:
        bits |= c.data_ptr()
        for s in c.stride()[:-1]:
            bits |= s * c.element_size()
    return bits & -bits


def _head_ok(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1024


def default_heads_per_program(num_heads: int, head_size: int) -> int:
    # About 1024 channels of K per program, at most all heads of the token.
    return max(1, min(next_pow2(num_heads), next_pow2(max(1, 1024 // head_size))))


def _pow2_floor(x: float) -> int:
    return 1 << max(0, int(x).bit_length() - 1)


def default_tokens_per_program(num_tokens: int, heads: int, row: int) -> int:
    # Few tokens: one per program (the shortest path). Many: about 4096 K + V elements a
    # program (``row`` = head_size + head_size_v), rounded down: 8 x 128 -> 2 tokens of 8 heads,
    # 1 x 576 -> 2 tokens.
    if num_tokens <= 64:
        return 1
    return max(1, min(8, _pow2_floor(4096 / (heads * row))))


def default_num_warps(tokens: int, heads: int, row: int) -> int:
    # About 64 elements a thread (2048 a warp). Wide rows then stay inside one warp, whose lanes
    # reduce them by shuffles: 1 x 576, 2 tokens, int8 compiles (sm90, with the bench's
    # strides) to 19 SASS instructions an element on 1 warp against 43 on 4, which reduce
    # through shared memory; 8 x 128, 2 tokens of 8 heads: 18 on 2 warps, 22 on 4.
    return max(1, min(8, _pow2_floor(tokens * heads * row / 2048)))


def _default_meta(spec, num_tokens: int, num_heads: int) -> dict[str, int]:
    width = max(spec.head_size, spec.head_size_v)
    row = spec.head_size + spec.head_size_v
    # Few tokens: latency is the path length of one program, so one head each (8 x 128 int8,
    # 1 token: 408 SASS instructions a thread instead of 1304 with 8 heads; the int4 tuning
    # on the H200 chose 1 head per program at 1-256 tokens too).
    heads = 1 if num_tokens <= 64 else default_heads_per_program(num_heads, width)
    tokens = default_tokens_per_program(num_tokens, heads, row)
    # Few tokens: K and V in separate programs too (on the H200 1.33-1.49x -> 1.23-1.34x a
    # copy's time at 1 and 16 tokens, int8 and e4m3, 8 x 128 and 1 x 576).
    return {
        "tokens_per_program": tokens,
        "heads_per_program": heads,
        "num_warps": default_num_warps(tokens, heads, row),
        "num_stages": 1,
        "split_kv": int(num_tokens <= 64),
    }


@dataclasses.dataclass(frozen=True)
class StoreKVPerTokenHeadSpec(VariantSpec):
    family: ClassVar[str] = "store_kv_per_token_head"

    fmt: str = axis("", choices=FORMATS, default="int8")
    head_size: int = axis("d", check=_head_ok, doc="an int from 1 to 1024", default=128)
    head_size_v: int = axis("dv", check=_head_ok, doc="an int from 1 to 1024", default=128)
    in_dtype: str = axis("", choices=FLOAT_DTYPES, default="bf16")
    arch: str = axis("", choices=ARCHS, default="sm90")
    target: str = axis("", choices=TARGETS, default="gpu")

    def derived(self) -> dict[str, Any]:
        fmt = formats.get(self.fmt)
        k_pieces, v_pieces = kv_pieces(self.head_size, self.head_size_v)
        return {
            "torch_dtype": _dtypes.SOURCE[self.in_dtype],
            "format_macros": fmt.macros,
            **fmt.constants,
            "k_pieces": k_pieces,
            "v_pieces": v_pieces,
            "k_groups": amax_groups(k_pieces),
            "v_groups": amax_groups(v_pieces),
            "k_pieces_text": pieces_text(k_pieces),
            "v_pieces_text": pieces_text(v_pieces),
            "min_tile": min(tile for _, tile, _ in k_pieces + v_pieces),
        }

    def default_meta(self, num_tokens: int, num_heads: int, row_align: int = 16) -> dict[str, int]:
        return _default_meta(self, num_tokens, num_heads)


@dataclasses.dataclass(frozen=True)
class StoreKVInt4Spec(VariantSpec):
    family: ClassVar[str] = "store_kv_int4_per_token_head"

    channels: int = axis("c", choices=INT4_CHANNELS, default=formats.INT4.default_group)
    head_size: int = axis("d", check=_head_ok, doc="an int from 1 to 1024", default=128)
    head_size_v: int = axis("dv", check=_head_ok, doc="an int from 1 to 1024", default=128)
    in_dtype: str = axis("", choices=FLOAT_DTYPES, default="bf16")
    arch: str = axis("", choices=ARCHS, default="sm90")
    target: str = axis("", choices=TARGETS, default="gpu")

    def default_meta(self, num_tokens: int, num_heads: int, row_align: int = 16) -> dict[str, int]:
        return default_int4_meta(
            num_tokens * num_heads * cdiv(self.head_size, self.channels), self.channels
        )

    def derived(self) -> dict[str, Any]:
        def groups(d: int) -> int:
            return cdiv(d, self.channels)

        words = self.head_size % 2 == 0 and self.head_size_v % 2 == 0
        fast = (
            self.target == "gpu"
            and self.arch in PACKED_COMPARE_ARCHS
            and words
            and self.in_dtype in PACKED_HALF
        )

        return {
            "torch_dtype": _dtypes.SOURCE[self.in_dtype],
            "groups": groups(self.head_size),
            "groups_v": groups(self.head_size_v),
            # even head sizes read words of two elements (see the template)
            "words": words,
            "packed": cdiv(self.head_size, 2),
            "packed_v": cdiv(self.head_size_v, 2),
            "format_macros": formats.INT4.macros,
            **formats.INT4.constants,
            # sm90's packed bf16x2 / f16x2 compares code two channels of a word at once
            "fast": fast,
            **(_packed_half(self.in_dtype) if fast else {}),
        }


def default_int4_meta(units: int, channels: int) -> dict[str, int]:
    """The int4 store's program for ``units`` scale groups of K: one warp (what the H200's
    tuning chose at every bucket but one), about units / 256 groups a program (few tokens spread
    over many small programs: 8 x 128 at 1 token took 1.22 us with 8 groups a program, 1.58 with
    32), at most 64 channels a thread (65536 tokens: 64 groups of 32)."""
    most = 32 * max(1, 64 // channels)
    return {
        "units_per_program": max(4, min(most, _pow2_floor(units / 256))),
        "num_warps": 1,
        "num_stages": 1,
    }
