"""Replay a variant's tuning trials in the order a worker ran them, synchronising after each, to
find which launch a GPU fault comes from (a tune reports a fault at the next call that waits on
the GPU, often a later trial's).

    python benchmarks/replay_trials.py VARIANT --rows 16,32,64,128 [--rounds N] [--quick]
        [--meta '{"block_n": 32, "num_stages": 2, "split_factor": 1}' ... | --all]

For each round and each bucket ``rows=R`` it builds the family's tuning problem as a worker
does (``kvgen.tune.problems.problem``), then for each config (default: the variant's default
config and the bucket's tuned config from ``tuned_configs/``; ``--all``: every feasible config
of the variant's search space at that bucket) makes a trial's launches: the check, then each
timed input set, then (without ``--quick``) a full trial (``gpu_evaluator``), each followed by
``torch.cuda.synchronize()``; it prints one line a launch and stops at the first error, naming
the round, the bucket, the config and the launch. ``--quick`` makes only one launch of each
kind: short enough to run under ``compute-sanitizer --tool memcheck``, which reports an access
outside a tensor even where it does not fault.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variant", help="a variant's name, e.g. "
                    "mla_decode_fp8_ds_mla-d576-dv512-bf16-wgmma-sm90-gpu")  # fmt: skip
    ap.add_argument("--rows", default="16,32,64,128", help="the buckets' rows, comma-separated")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="one launch of each kind (sanitizer)")
    ap.add_argument("--meta", action="append", default=[], help="a config as JSON (repeatable)")
    ap.add_argument("--all", action="store_true", help="every feasible config of the space")
    args = ap.parse_args(argv)

    import torch

    from kvgen import registry
    from kvgen.runtime import meta_params
    from kvgen.space import load_space
    from kvgen.tune import problems

    (spec,) = registry.lookup([args.variant], "sm90", "gpu")
    buckets = [{"rows": int(r)} for r in args.rows.split(",")]
    for rnd in range(args.rounds):
        for bucket in buckets:
            metas = [json.loads(m) for m in args.meta]
            if args.all:
                metas = load_space(spec.template).feasible(spec, bucket)
            elif not metas:
                metas = [spec.default_meta(**bucket)]
                tuned = meta_params(spec, **bucket)  # (the defaults where none is tuned)
                if tuned not in metas:
                    metas.append(tuned)
            where = f"round {rnd} rows={bucket['rows']}"
            t0 = time.perf_counter()
            try:
                run, check, n_sets = problems.problem(spec, bucket, "cuda")
                torch.cuda.synchronize()
            except Exception as exc:
                print(f"FAULT {where} building the problem: {type(exc).__name__}: {exc}")
                return 1
            print(f"{where}: problem built in {time.perf_counter() - t0:.1f} s", flush=True)
            evaluate = None if args.quick else problems.gpu_evaluator(spec, bucket)
            for meta in metas:
                steps = [("check", check, (meta,))]
                steps += [(f"set {i}", run, (i, meta)) for i in range(n_sets)]
                if evaluate is not None:
                    steps.append(("trial", evaluate, (meta,)))
                for what, fn, fn_args in steps:
                    try:
                        out = fn(*fn_args)
                        torch.cuda.synchronize()
                    except Exception as exc:
                        print(f"FAULT {where} {meta} {what}: {type(exc).__name__}: {exc}"[:400])
                        return 1
                    shown = f" -> {out:.2f} us" if isinstance(out, float) else ""
                    print(f"  ok {where} {meta} {what}{shown}", flush=True)
    print("no fault")
    return 0


if __name__ == "__main__":
    sys.exit(main())
