"""Does the MLA decode's best config change with several KV heads?

The op looks its meta-parameters up by ``rows = seq_len_q * num_heads_q / num_heads_k`` (the
query rows one KV head's tile carries), tuned on one-KV-head caches. For each case below this
times every point of the variant's space on a cache with ``h_kv`` KV heads (the tuning
problem: FlashMLA's 128 x 4096 batch and the mixed lengths, page 64, checked against the
float64 reference) and prints the config the op would use against the grid's best.

    python benchmarks/kv_heads_configs.py --json out.json [--variant wgmma]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvgen import runtime
from kvgen.bench import harness
from kvgen.families.mla_decode import MLADecodeSpec
from kvgen.space import load_space

# (h_q, h_kv): DeepSeek's one KV head, and FlashMLA's test file's several
CASES = [(128, 1), (128, 2), (128, 8), (16, 8)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="wgmma")
    ap.add_argument("--jobs", type=int, default=12, help="compile processes")
    ap.add_argument("--json", help="write the measurements here")
    ap.add_argument("--commit", help="the commit to record (a copied checkout's .git may be older)")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # (run as a script, python -P)
    from compare_samplers import measure_grid

    arch, target = runtime.local_target()
    spec = MLADecodeSpec(576, 512, "bf16", args.variant, arch, target)
    space = load_space(spec.template)
    from kvgen.tune.precompile import compile_all

    # Compile every point once, on small problems (the kernels depend on the meta-parameters
    # and on whether there is one KV head, not on the sizes): the timing problems at 8 KV heads
    # hold ~10 GB each, too much for a compile process apiece.
    feasible = space.feasible(spec)
    for h_kv in sorted({1 if h == 1 else 2 for _, h in CASES}):
        compile_all(spec, {"rows": 16, "h_kv": h_kv}, feasible, args.jobs, progress=print)
    results = []
    print(f"{'h_q':>4} {'h_kv':>4} {'rows':>4}  {'chosen us':>9}  {'best us':>9}  ratio  best")
    for h_q, h_kv in CASES:
        rows = h_q // h_kv
        bucket = {"rows": max(rows, 16), "h_kv": h_kv}
        times = measure_grid(spec, bucket, space, fake=False, jobs=1)
        chosen = runtime.meta_params(spec, rows=rows)
        ok = {k: t for k, t in times.items() if t is not None}
        best_key = min(ok, key=ok.get)
        t_chosen = times.get(json.dumps(chosen, sort_keys=True))
        ratio = t_chosen / ok[best_key] if t_chosen else float("nan")
        print(
            f"{h_q:4d} {h_kv:4d} {rows:4d}  {t_chosen or float('nan'):9.1f}  {ok[best_key]:9.1f}"
            f"  {ratio:5.3f}  {best_key}",
            flush=True,
        )
        results.append(
            {
                "h_q": h_q,
                "h_kv": h_kv,
                "rows": rows,
                "chosen": chosen,
                "chosen_us": t_chosen,
                "best": json.loads(best_key),
                "best_us": ok[best_key],
                "grid": times,
            }
        )
    if args.json:
        with open(args.json, "w") as f:
            env = harness.environment(args.commit)
            json.dump({"spec": spec.name, "env": env, "cases": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
