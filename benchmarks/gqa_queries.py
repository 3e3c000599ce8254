"""Time the GQA decode with several queries a sequence (speculative decoding), each variant.

The op takes the rows variant for 1 to 8 causal queries a sequence where queries x query heads
fit 16 rows a KV head; its tuned times are looked up at that many rows. This times the op as it
chooses and the op held to the portable variant, at the bench's shapes (8 KV heads x 128,
block 16, bf16 queries), and checks that the two agree.

    python -P benchmarks/gqa_queries.py --formats int8,fp8e4m3 --queries 1,2,4 --heads 32
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from kvgen.bench import gqa_decode as bench
from kvgen.bench import harness


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="int8,fp8e4m3")
    ap.add_argument("--queries", default="1,2,4", help="queries a sequence, comma-separated")
    ap.add_argument("--heads", default="32", help="query heads, comma-separated")
    ap.add_argument("--json", help="write the measurements here")
    args = ap.parse_args(argv)

    from kvgen.ops import _gqa_decode, flash_attn_with_kvcache

    both = _gqa_decode.VARIANTS
    points = []
    for label, batch, seqlen in bench.SHAPES:
        for kv in args.formats.split(","):
            for h_q in (int(h) for h in args.heads.split(",")):
                q1, k, v, ks, vs, table, sl = bench.problem(kv, 0, [seqlen] * batch, h_q, "cuda")
                for s_q in (int(s) for s in args.queries.split(",")):
                    gen = torch.Generator(device="cuda").manual_seed(s_q)
                    q = torch.randn(batch, s_q, h_q, bench.HEAD, device="cuda", generator=gen)
                    q = q.to(q1.dtype)

                    def call(q=q, k=k, v=v, ks=ks, vs=vs, table=table, sl=sl, s_q=s_q):
                        return flash_attn_with_kvcache(
                            q, k, v, cache_seqlens=sl, block_table=table, k_scale_cache=ks,
                            v_scale_cache=vs, causal=s_q > 1, return_softmax_lse=True,
                        )  # fmt: skip

                    res = {}
                    for which, variants in (("op", both), ("portable", ("portable",))):
                        _gqa_decode.VARIANTS = variants
                        try:
                            spec = _gqa_decode.chosen_spec(
                                q, k, v, cache_seqlens=sl, block_table=table, k_scale_cache=ks,
                                v_scale_cache=vs,
                            )  # fmt: skip
                            out, lse = call()
                            us = harness.graph_time_us(lambda _, c=call: c(), 1, calls=8,
                                                       replays=5, trials=5)  # fmt: skip
                        finally:
                            _gqa_decode.VARIANTS = both
                        res[which] = (spec.variant, us, out.float(), lse)
                    agree = bool(
                        torch.allclose(res["op"][2], res["portable"][2], atol=2e-2, rtol=2e-2)
                        and torch.allclose(res["op"][3], res["portable"][3], atol=1e-2)
                    )
                    op_variant, op_us = res["op"][:2]
                    p_us = res["portable"][1]
                    print(f"{kv:8} {label:>10} h_q={h_q} s_q={s_q}: op ({op_variant}) "
                          f"{op_us:7.1f} us, portable {p_us:7.1f} us, x{op_us / p_us:.2f}, "
                          f"agree {agree}", flush=True)  # fmt: skip
                    points.append({"kv": kv, "shape": label, "h_q": h_q, "s_q": s_q,
                                   "variant": op_variant, "op_us": op_us, "portable_us": p_us,
                                   "agree": agree})  # fmt: skip
                del k, v, ks, vs
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"points": points}, f, indent=1, sort_keys=True)
    return 0 if all(p["agree"] for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
