"""What a tuning trial of a per-token-head store runs: the bench's rotated sets, checked byte
for byte against the reference."""

from __future__ import annotations

import torch

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
        )
    )
    launch = load(spec).launch
    sets = case.data  # the rotated (k, v, caches, scales, slots) sets

    def run(i, meta):
        launch(*sets[i], **meta)

    def check(meta):
        from kvgen.formats import per_token_head as ref

        k, v, kc, vc, ks, vs, slots = sets[0]
        n = min(k.shape[0], 4096)
        k, v, slots = torch.randn_like(k[:n]), torch.randn_like(v[:n]), slots[:n]
        launch(k, v, kc, vc, ks, vs, slots, **meta)
        want = [x.cpu().clone() for x in (kc, vc, ks, vs)]
        ref.store(k.cpu(), v.cpu(), *want, slots.cpu())
        got = [x.cpu() for x in (kc, vc, ks, vs)]
        return all(
            torch.equal(g.view(torch.uint8), w.view(torch.uint8))
            for g, w in zip(got, want, strict=True)
        )

    return run, check, case.n_sets
