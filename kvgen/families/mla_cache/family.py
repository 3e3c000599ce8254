"""The ``Family`` object of kvgen/families/mla_cache/ (what the registry lists)."""

from __future__ import annotations

from kvgen.codegen.spec import VariantSpec
from kvgen.families._base import Family
from kvgen.families.mla_cache import (
    CACHE_FORMATS,
    READ_FORMATS,
    ConcatAndCacheMLASpec,
    GatherMLACacheSpec,
)
from kvgen.families.mxfp4_mla import FLOAT_DTYPES


class ConcatAndCacheMLA(Family):
    """``concat_and_cache_mla``: the latent and RoPE parts of each token into its MLA cache row
    (bf16 / fp16, per-tensor fp8, or the 656-byte fp8_ds_mla record)."""

    spec_class = ConcatAndCacheMLASpec
    bench_ops = ("mla-fp8_ds_mla", "mla-fp8")

    def variants(self, arch: str, target: str) -> list[VariantSpec]:
        return [
            ConcatAndCacheMLASpec(fmt, 512, 64, dt, arch, target)
            for fmt in CACHE_FORMATS
            for dt in FLOAT_DTYPES
            if not (fmt == "auto" and dt == "fp32")
        ]

    def default_tuned(self, arch: str) -> list[VariantSpec]:
        # the quantized rows from bf16 activations (what the bench measures)
        return [s for s in self.variants(arch, "gpu") if s.fmt != "auto" and s.in_dtype == "bf16"]

    def verify(self, spec, device):
        from kvgen.families.mla_cache.verify import verify_concat_and_cache_mla

        return verify_concat_and_cache_mla(spec, device)

    def tuning_problem(self, spec, bucket, device):
        from kvgen.families.mla_cache.tuning import store_problem

        return store_problem(spec, bucket, device)

    def bench(self, op, bench):
        from kvgen.bench import store

        fmt = op.removeprefix("mla-")
        cases = store.mla_cache_cases(bench.device, bench.sizes, fmt, slot_order=bench.slot_order)
        return bench.stores(cases)


class GatherMLACache(Family):
    """``gather_mla_cache``: the fp8 / fp8_ds_mla MLA cache rows of given slots, dequantized."""

    spec_class = GatherMLACacheSpec

    def variants(self, arch: str, target: str) -> list[VariantSpec]:
        return [
            GatherMLACacheSpec(fmt, 512, 64, dt, arch, target)
            for fmt in READ_FORMATS
            for dt in FLOAT_DTYPES
        ]

    def default_tuned(self, arch: str) -> list[VariantSpec]:
        return [s for s in self.variants(arch, "gpu") if s.dtype == "bf16"]

    def verify(self, spec, device):
        from kvgen.families.mla_cache.verify import verify_gather_mla_cache

        return verify_gather_mla_cache(spec, device)

    def tuning_problem(self, spec, bucket, device):
        from kvgen.families.mla_cache.tuning import gather_problem

        return gather_problem(spec, bucket, device)


FAMILIES = (ConcatAndCacheMLA(), GatherMLACache())
