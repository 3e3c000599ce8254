"""The ``Family`` object of kvgen/families/gqa_decode/ (what the registry lists)."""

from __future__ import annotations

from kvgen.codegen.spec import VariantSpec
from kvgen.families._base import Family
from kvgen.families.gqa_decode import (
    HEAD_SIZES,
    INT4_GROUPS,
    KV_FORMATS,
    ROWS_INT4_GROUPS,
    ROWS_MAX_ROWS,
    ROWS_OFFERED,
    GQADecodeSpec,
    available,
    inline_row_align,
)

# Under the interpreter (CI) each format once at 128 / 128, plus the corners of the axes: odd
# widths, V narrower than K, every int4 group.
_INTERP = (
    *((128, 128, "bf16", kv, 32 if kv == "int4" else 0) for kv in KV_FORMATS),
    (128, 128, "fp16", "auto", 0),
    (80, 80, "bf16", "int8", 0),
    (192, 128, "fp16", "fp8e4m3", 0),
    (64, 64, "bf16", "int4", 16),
    (96, 96, "bf16", "int4", 64),
    (256, 256, "fp16", "int4", 128),
)


class GQADecode(Family):
    """FlashAttention's ``flash_attn_with_kvcache`` over the per-token-head caches (bf16 / fp16,
    int8, fp8 e4m3 / e5m2, int4 levels)."""

    spec_class = GQADecodeSpec

    def variants(self, arch: str, target: str) -> list[VariantSpec]:
        if target == "interp":
            return [
                GQADecodeSpec(d, dv, dt, kv, g, "portable", arch, target)
                for d, dv, dt, kv, g in _INTERP
            ]
        return [
            GQADecodeSpec(d, dv, dt, kv, g, "portable", arch, target)
            for d, dv in HEAD_SIZES
            for dt in ("bf16", "fp16")
            for kv in KV_FORMATS
            for g in (INT4_GROUPS if kv == "int4" else (0,))
        ] + self._rows(arch, target, ("bf16", "fp16"))

    @staticmethod
    def _rows(arch: str, target: str, dtypes, int4_groups=ROWS_INT4_GROUPS) -> list[VariantSpec]:
        """The Hopper (rows) variants kvgen offers where they exist: 128 / 128 caches of the
        ROWS_OFFERED formats (int4 at ``int4_groups`` channels a scale)."""
        if not available("rows", arch, target):
            return []
        return [
            GQADecodeSpec(128, 128, dt, kv, g, "rows", arch, target)
            for dt in dtypes
            for kv in ROWS_OFFERED
            for g in (int4_groups if kv == "int4" else (0,))
        ]

    def bucket_applies(self, spec: VariantSpec, bucket: dict[str, int]) -> bool:
        # The rows variant's row_align buckets: 16-byte aligned rows, and vLLM's inline-scale
        # rows of the spec's format (int8 / fp8: 4, int4 at 32 channels a scale: 8)
        align = bucket.get("row_align", 16)
        return align == 16 or align == inline_row_align(spec.kv, spec.group, spec.head_size)

    def tuned_by_default(self, spec: VariantSpec, bucket: dict[str, int]) -> bool:
        # int4's inline rows (row_align 8) are not tuned by default: over a grid of stages x
        # piece length x split factor the configs tuned on 16-byte rows were the fastest there
        # on an H100 (benchmarks/gqa_rows_inline_sweep.py), where int8's inline rows gained 6 %
        # (fp8 e4m3 2 %); the op then takes the row_align 16 entry, the nearest bucket.
        if spec.variant == "rows" and spec.kv == "int4" and bucket.get("row_align", 16) < 16:
            return False
        # The portable variant is not tuned at the rows the rows variant takes (at most
        # ROWS_MAX_ROWS) where kvgen offers a rows variant of the same cache and queries on the
        # arch (``_rows``): there the op takes that one, tuned in the same run (an untuned
        # portable one counts as slower), which measured 1.3-2.2x faster for int8, fp8 e4m3
        # and int4 on the H200 (1.04-1.24x for e5m2 at its defaults, on an H100), where
        # tuning the portable variant gained 0-2 % over its defaults at those rows.
        if spec.variant != "portable" or bucket.get("rows", ROWS_MAX_ROWS + 1) > ROWS_MAX_ROWS:
            return True

        def cache(s):
            return s.head_size, s.head_size_v, s.dtype, s.kv, s.group

        offered = self._rows(spec.arch, spec.target, (spec.dtype,))
        return cache(spec) not in {cache(r) for r in offered}

    def default_tuned(self, arch: str) -> list[VariantSpec]:
        # Llama / Qwen's 128 / 128 with bf16 queries, every format (int4 at 32 channels a
        # scale), and the Hopper variants of that shape for bf16 and fp16 queries (the op takes
        # them where tuned faster; an untuned portable variant counts as slower)
        return [
            GQADecodeSpec(128, 128, "bf16", kv, 32 if kv == "int4" else 0, "portable", arch, "gpu")
            for kv in KV_FORMATS
        ] + self._rows(arch, "gpu", ("bf16", "fp16"), int4_groups=(32,))

    bench_ops = ("gqa_decode",)

    def bench(self, op, bench):
        from kvgen.bench import gqa_decode

        rows = gqa_decode.run(
            bench.device,
            bench.copy_bw,
            progress=lambda r: bench.log(
                f"  gqa_decode {r.kv_format} {r.lengths} h={r.heads}: {r.graph_us:.1f} us"
            ),
        )
        return "gqa", rows

    def verify(self, spec, device):
        from kvgen.families.gqa_decode.verify import verify_gqa_decode

        return verify_gqa_decode(spec, device)

    def tuning_problem(self, spec, bucket, device):
        from kvgen.families.gqa_decode.tuning import problem

        return problem(spec, bucket, device)


FAMILIES = (GQADecode(),)
