"""The ``Family`` objects of kvgen/families/per_token_head/ (what the registry lists)."""

from __future__ import annotations

from kvgen.codegen.spec import VariantSpec
from kvgen.families._base import Family
from kvgen.families.per_token_head import (
    FLOAT_DTYPES,
    FORMATS,
    HEAD_SIZES,
    INT4_CHANNELS,
    StoreKVInt4Spec,
    StoreKVPerTokenHeadSpec,
)

# The shapes `kvgen bench` measures, (num_kv_heads, head_size) with V as wide as K, and so the
# ones `kvgen tune` tunes by default.
BENCH_SHAPES = ((8, 128), (1, 576))


class _StoreKVFamily(Family):
    # the spec's first field: every value the listing covers, and those tuned by default
    firsts: tuple
    tuned_firsts: tuple

    def variants(self, arch: str, target: str) -> list[VariantSpec]:
        return [
            self.spec_class(first, d, dv, dt, arch, target)
            for d, dv in HEAD_SIZES
            for dt in FLOAT_DTYPES
            for first in self.firsts
        ]

    def default_tuned(self, arch: str) -> list[VariantSpec]:
        # bf16 input at the bench's shapes (int4 with vLLM's 32 channels a scale); 576 / 576 is
        # not in the listing (its 576 pairs with 512) and is named here
        return [
            self.spec_class(first, d, d, "bf16", arch, "gpu")
            for _, d in BENCH_SHAPES
            for first in self.tuned_firsts
        ]

    def bucket_applies(self, spec: VariantSpec, bucket: dict[str, int]) -> bool:
        # DeepSeek-wide heads (576) come one kv head a token; 8 or 32 kv heads are 128 wide
        heads = bucket.get("num_heads")
        return heads is None or (spec.head_size >= 512) == (heads == 1)

    def bench(self, op, bench):
        import itertools

        from kvgen.bench import store

        # op: the cache format (int8, fp8e4m3, fp8e5m2, int4), at each of the bench's shapes,
        # with separate scale caches and in vLLM's rows with the scales inline
        return bench.stores(
            itertools.chain.from_iterable(
                store.kv_cases(
                    bench.device,
                    bench.sizes,
                    op,
                    heads,
                    d,
                    layout=layout,
                    slot_order=bench.slot_order,
                )
                for heads, d in BENCH_SHAPES
                for layout in store.KV_LAYOUTS
            )
        )

    def verify(self, spec, device):
        from kvgen.families.per_token_head.verify import verify_store_kv

        return verify_store_kv(self.op, spec, device)

    def tuning_problem(self, spec, bucket, device):
        from kvgen.families.per_token_head.tuning import store_problem

        return store_problem(spec, bucket, device)


class StoreKVPerTokenHead(_StoreKVFamily):
    """vLLM's ``triton_reshape_and_cache_flash_per_token_head_quant``: int8 / fp8 codes with one
    fp32 scale per (token, head)."""

    spec_class = StoreKVPerTokenHeadSpec
    firsts = tuned_firsts = FORMATS
    bench_ops = FORMATS
    bench_default = ("int8", "fp8e4m3")

    @property
    def op(self):
        """The public op whose kernels this family generates."""
        from kvgen.ops import triton_reshape_and_cache_flash_per_token_head_quant

        return triton_reshape_and_cache_flash_per_token_head_quant


class StoreKVInt4PerTokenHead(_StoreKVFamily):
    """vLLM's ``triton_reshape_and_cache_flash_int4_per_token_head``: packed int4 codes on
    Gaussian-friendly levels with fp16 group scales."""

    spec_class = StoreKVInt4Spec
    firsts, tuned_firsts = INT4_CHANNELS, (32,)  # vLLM's 32 channels a scale
    bench_ops = ("int4",)

    @property
    def op(self):
        """The public op whose kernels this family generates."""
        from kvgen.ops import triton_reshape_and_cache_flash_int4_per_token_head

        return triton_reshape_and_cache_flash_int4_per_token_head


FAMILIES = (StoreKVPerTokenHead(), StoreKVInt4PerTokenHead())
