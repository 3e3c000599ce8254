"""What a tuning trial of a per-token-head store runs: the bench's rotated sets, checked byte
for byte against the reference."""

from __future__ import annotations

from kvgen import _dtypes
from kvgen.codegen import load
from kvgen.tune.tuner import TrialFailed


def store_problem(spec, bucket, device):
    from kvgen.bench.store import kv_cases

    fmt = "int4" if spec.family == "store_kv_int4_per_token_head" else spec.fmt
    if fmt == "int4" and spec.channels != 32:
        raise TrialFailed("the tuning problem builds int4 caches with 32 channels per scale")
    case = next(
        kv_cases(
            device,
            (bucket["num_tokens"],),
            fmt,
            bucket["num_heads"],
            spec.head_size,
            _dtypes.TORCH[spec.in_dtype],
            # a row_align bucket under 16: vLLM's rows with the scales inline
            layout="inline" if bucket.get("row_align", 16) < 16 else "separate",
        )
    )
    from kvgen.bench.store import kv_store_checker

    launch = load(spec).launch
    sets = case.data  # the rotated (k, v, caches, scales, slots) sets
    checker = kv_store_checker(sets[0])  # the reference's bytes made once, for every candidate

    def run(i, meta):
        launch(*sets[i], **meta)

    def check(meta):
        return checker(lambda *a: launch(*a, **meta))

    return run, check, case.n_sets
