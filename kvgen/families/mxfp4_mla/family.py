"""The ``Family`` objects of kvgen/families/mxfp4_mla/ (what the registry lists)."""

from __future__ import annotations

import itertools

from kvgen.codegen.spec import VariantSpec
from kvgen.families._base import Family
from kvgen.families.mxfp4_mla import (
    FLOAT_DTYPES,
    GROUPS,
    LATENTS,
    LAYOUTS,
    GatherMXFP4MLASpec,
    GatherMXFP4RopeMLASpec,
    StoreMXFP4MLASpec,
    StoreMXFP4RopeMLASpec,
)


class _MXFP4Family(Family):
    def variants(self, arch: str, target: str) -> list[VariantSpec]:
        return [
            self.spec_class(group, latent, dt, layout, arch, target)
            for group, latent, dt, layout in itertools.product(
                GROUPS, LATENTS, FLOAT_DTYPES, LAYOUTS
            )
            if latent % group == 0
        ]

    def default_tuned(self, arch: str) -> list[VariantSpec]:
        # DeepSeek's latent in the OCP group size, in the paged layer view (the bench's shape)
        return [
            s
            for s in self.variants(arch, "gpu")
            if (s.latent, s.group, s.layout) == (512, 32, "paged")
        ]


class StoreMXFP4MLA(_MXFP4Family):
    """``store_mxfp4_mla``: quantize the MLA latent to MXFP4 rows and scatter them by slot."""

    spec_class = StoreMXFP4MLASpec
    bench_ops = ("mxfp4",)

    def bench(self, op, bench):
        from kvgen.bench import store

        cases = store.mxfp4_cases(
            bench.device, bench.sizes, bench.latent, bench.group, slot_order=bench.slot_order
        )
        return bench.stores(cases)

    def verify(self, spec, device):
        from kvgen.families.mxfp4_mla.verify import verify_store_mxfp4

        return verify_store_mxfp4(spec, device)

    def tuning_problem(self, spec, bucket, device):
        from kvgen.families.mxfp4_mla.tuning import store_problem

        return store_problem(spec, bucket, device)


class StoreMXFP4RopeMLA(Family):
    """``store_mxfp4_mla(..., k_pe=)``: the MXFP4 rows with the RoPE part as bf16 after the
    scales (DeepSeek's 576 / 512: 400-byte rows, the rows the MXFP4 decode reads)."""

    spec_class = StoreMXFP4RopeMLASpec

    def variants(self, arch: str, target: str) -> list[VariantSpec]:
        return [
            StoreMXFP4RopeMLASpec(group, 512, dt, layout, arch, target, 64)
            for group, dt, layout in itertools.product(GROUPS, FLOAT_DTYPES, LAYOUTS)
        ]

    def default_tuned(self, arch: str) -> list[VariantSpec]:
        return [s for s in self.variants(arch, "gpu") if (s.group, s.layout) == (32, "paged")]

    def verify(self, spec, device):
        from kvgen.families.mxfp4_mla.verify import verify_store_mxfp4_rope

        return verify_store_mxfp4_rope(spec, device)

    def tuning_problem(self, spec, bucket, device):
        from kvgen.families.mxfp4_mla.tuning import store_rope_problem

        return store_rope_problem(spec, bucket, device)


class GatherMXFP4MLA(_MXFP4Family):
    """``gather_mxfp4_mla``: read the MXFP4 rows of given slots back, dequantized."""

    spec_class = GatherMXFP4MLASpec
    bench_ops = ("mxfp4-gather",)

    def bench(self, op, bench):
        from kvgen.bench import store

        cases = store.mxfp4_gather_cases(bench.device, bench.sizes, bench.latent, bench.group)
        return bench.stores(cases)

    def verify(self, spec, device):
        from kvgen.families.mxfp4_mla.verify import verify_gather_mxfp4

        return verify_gather_mxfp4(spec, device)

    def tuning_problem(self, spec, bucket, device):
        from kvgen.families.mxfp4_mla.tuning import gather_problem

        return gather_problem(spec, bucket, device)


class GatherMXFP4RopeMLA(Family):
    """``gather_mxfp4_mla(..., rope_dim=)``: the rows with the RoPE part read back as
    ``[rows, latent + rope]``."""

    spec_class = GatherMXFP4RopeMLASpec

    def variants(self, arch: str, target: str) -> list[VariantSpec]:
        return [
            GatherMXFP4RopeMLASpec(group, 512, dt, layout, arch, target, 64)
            for group, dt, layout in itertools.product(GROUPS, FLOAT_DTYPES, LAYOUTS)
        ]

    def default_tuned(self, arch: str) -> list[VariantSpec]:
        return [
            s
            for s in self.variants(arch, "gpu")
            if (s.group, s.layout, s.dtype) == (32, "paged", "bf16")
        ]

    def verify(self, spec, device):
        from kvgen.families.mxfp4_mla.verify import verify_gather_mxfp4_rope

        return verify_gather_mxfp4_rope(spec, device)

    def tuning_problem(self, spec, bucket, device):
        from kvgen.families.mxfp4_mla.tuning import gather_rope_problem

        return gather_rope_problem(spec, bucket, device)


FAMILIES = (StoreMXFP4MLA(), StoreMXFP4RopeMLA(), GatherMXFP4MLA(), GatherMXFP4RopeMLA())
