"""The ``Family`` objects of kvgen/families/mla_decode/ (what the registry lists)."""

from __future__ import annotations

from kvgen.codegen.spec import VariantSpec
from kvgen.families._base import Family
from kvgen.families.mla_decode import (
    WIDTHS,
    MLADecodeDSMLASpec,
    MLADecodeFP8Spec,
    MLADecodeMXFP4Spec,
    MLADecodeSpec,
    available,
    variants_for,
)


class MLADecode(Family):
    """FlashMLA's ``flash_mla_with_kvcache`` over a paged bf16 / fp16 latent cache."""

    spec_class = MLADecodeSpec

    def variants(self, arch: str, target: str) -> list[VariantSpec]:
        return [
            MLADecodeSpec(d, dv, dt, v, arch, target)
            for d, dv in WIDTHS
            for dt in ("bf16", "fp16")
            for v in variants_for("auto")
            if available(v, arch, target)
        ]

    def default_tuned(self, arch: str) -> list[VariantSpec]:
        # DeepSeek's 576 / 512 in bf16, every variant this arch has (the op picks by tuned time)
        return [s for s in self.variants(arch, "gpu") if (s.head_dim, s.dtype) == (576, "bf16")]

    bench_ops = ("decode",)

    def bench(self, op, bench):
        from kvgen.bench import decode

        if bench.compare_default:
            bench.log(
                "note: --compare-default times the store ops only; `kvgen show` lists the "
                "decode's default and tuned times per bucket, measured when it was tuned"
            )
        rows = decode.run(
            bench.device,
            bench.copy_bw,
            bench.matmul(),
            progress=lambda r: bench.log(
                f"  decode {r.variant} {r.lengths} h={r.heads}: {r.graph_us:.1f} us"
            ),
        )
        return "decode", rows

    def verify(self, spec, device):
        from kvgen.families.mla_decode.verify import verify_mla_decode

        return verify_mla_decode(spec, device)

    def tuning_problem(self, spec, bucket, device):
        from kvgen.families.mla_decode.tuning import problem

        return problem(spec, bucket, device)


class _QuantizedDecode(Family):
    """What the decodes over quantized caches share: tuned on DeepSeek's 576 / 512 with bf16
    queries, with the bf16 decode's tuning problem over the cache in their format."""

    def default_tuned(self, arch: str) -> list[VariantSpec]:
        return [s for s in self.variants(arch, "gpu") if (s.head_dim, s.dtype) == (576, "bf16")]

    def tuning_problem(self, spec, bucket, device):
        from kvgen.families.mla_decode.tuning import problem

        return problem(spec, bucket, device)


class MLADecodeDSMLA(_QuantizedDecode):
    """``flash_mla_with_kvcache`` over the 656-byte fp8_ds_mla cache (K and V dequantized on
    chip); the portable variant and, on sm90, the wgmma one."""

    spec_class = MLADecodeDSMLASpec

    def variants(self, arch: str, target: str) -> list[VariantSpec]:
        return [
            MLADecodeDSMLASpec(576, 512, "bf16", v, arch, target)
            for v in variants_for("fp8_ds_mla")
            if available(v, arch, target)
        ]

    def verify(self, spec, device):
        from kvgen.families.mla_decode.verify import verify_quantized_decode

        return verify_quantized_decode(spec, device)


class MLADecodeFP8(_QuantizedDecode):
    """``flash_mla_with_kvcache`` over a per-tensor fp8 cache (e4m3fn codes of every channel,
    one k_scale), K and V dequantized on chip; the portable variant and, on sm90, the wgmma
    one."""

    spec_class = MLADecodeFP8Spec

    def variants(self, arch: str, target: str) -> list[VariantSpec]:
        return [
            MLADecodeFP8Spec(576, 512, dt, v, arch, target)
            for dt in ("bf16", "fp16")
            for v in variants_for("fp8")
            if available(v, arch, target)
        ]

    def verify(self, spec, device):
        from kvgen.families.mla_decode.verify import verify_quantized_decode

        return verify_quantized_decode(spec, device)


class MLADecodeMXFP4(_QuantizedDecode):
    """``flash_mla_with_kvcache`` over MXFP4 rows (group 32, RoPE as bf16 or none), K and V
    dequantized on chip; the portable variant and, on sm90, the wgmma one (bf16 queries)."""

    spec_class = MLADecodeMXFP4Spec

    def variants(self, arch: str, target: str) -> list[VariantSpec]:
        return [
            MLADecodeMXFP4Spec(d, 512, dt, v, arch, target)
            for d in (576, 512)
            for dt in ("bf16", "fp16")
            for v in variants_for("mxfp4")
            if available(v, arch, target) and (v == "portable" or dt == "bf16")
        ]

    def verify(self, spec, device):
        from kvgen.families.mla_decode.verify import verify_mxfp4_decode

        return verify_mxfp4_decode(spec, device)


FAMILIES = (MLADecode(), MLADecodeDSMLA(), MLADecodeFP8(), MLADecodeMXFP4())
