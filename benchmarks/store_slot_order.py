"""What the slot order costs the stores whose rows are not whole 32-byte sectors.

`kvgen bench` writes each store's tokens to a random choice of the cache's slots (decode steps
of many sequences). Where a row is not a multiple of 32 bytes (the MXFP4 MLA row: 272 bytes;
vLLM's inline int8 / fp8 rows of one 576-wide head: 580; int4's: 324), neighbouring slots share
sectors, and random slots make different programs write the two halves of a sector at different
times. This times each store and its floor (the same bytes between the same addresses without
the format's arithmetic, ``kvgen/bench/_floor_kernel.py``) with random slots, with sequential
ones (slot i for token i, as one prefill of a fresh sequence into a fresh cache writes them)
and with paged ones (whole pages taken at random from the cache, each filled in token order:
a prefill as a paged engine such as vLLM writes it), in one process,
orders alternated over ``--rounds`` rounds, each result checked byte for byte against the
reference; ratios to the device-to-device copy measured in the same run. A store that reads at
its goal with sequential or paged slots and not with random ones is bound by the layout's
shared sectors, not by its own work.

    python -P benchmarks/store_slot_order.py [--stores mxfp4,int8-1x576-inline,...]
        [--orders random,sequential,paged] [--tokens 65536] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from kvgen.bench import harness, store

#: store label -> (cases builder of (device, tokens, slot order), the issue's goal x copy)
STORES = {
    "mxfp4": (lambda d, t, o: store.mxfp4_cases(d, t, slot_order=o), 0.93),
    **{
        f"{fmt}-{heads}x{size}-{layout}": (
            lambda d, t, o, fmt=fmt, heads=heads, size=size, layout=layout: store.kv_cases(
                d, t, fmt, heads, size, layout=layout, slot_order=o
            ),
            0.90,
        )
        for fmt in ("int8", "fp8e4m3", "int4")
        for heads, size in ((1, 576), (8, 128))
        for layout in ("separate", "inline")
    },
}
DEFAULT = (
    "mxfp4,int8-1x576-inline,fp8e4m3-1x576-inline,int4-1x576-inline,int8-1x576-separate,"
    "int8-8x128-inline"
)


def summary(points: list[dict]) -> list[str]:
    """A line a store: the median time and x copy of each order (store, then floor), and the
    sequential / random time ratio; a wrong result says so instead."""
    lines = []
    for label in dict.fromkeys(p["store"] for p in points):
        mine = [p for p in points if p["store"] == label]
        if not all(p["correct"] for p in mine):
            lines.append(f"{label}: WRONG result (see the points above)")
            continue
        parts, us = [], {}
        for order in store.SLOT_ORDERS:
            got = [p for p in mine if p["order"] == order]
            if not got:
                continue
            us[order] = statistics.median(p["us"] for p in got)
            ratio = statistics.median(p["x_copy"] for p in got)
            floor = [p["floor_x_copy"] for p in got if p["floor_x_copy"] is not None]
            floor_text = f", floor {statistics.median(floor):.3f}" if floor else ""
            parts.append(f"{order} {us[order]:.2f} us ({ratio:.3f} of copy{floor_text})")
        line = f"{label} (goal {mine[0]['goal']:.2f}): " + "; ".join(parts)
        if "random" in us:
            line += "".join(
                f"; {order} / random {t / us['random']:.3f}"
                for order, t in us.items()
                if order != "random"
            )
        lines.append(line)
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stores", default=DEFAULT, help="comma-separated: " + ", ".join(STORES))
    ap.add_argument("--tokens", type=int, default=65536)
    orders_help = "comma-separated slot orders: " + ", ".join(store.SLOT_ORDERS)
    ap.add_argument("--orders", default=",".join(store.SLOT_ORDERS), help=orders_help)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every order")
    ap.add_argument("--json", help="write every point here")
    args = ap.parse_args(argv)
    labels = [s.strip() for s in args.stores.split(",") if s.strip()]
    if unknown := [s for s in labels if s not in STORES]:
        ap.error(f"unknown stores {unknown}; known: {', '.join(STORES)}")
    slot_orders = [o.strip() for o in args.orders.split(",") if o.strip()]
    if not slot_orders or any(o not in store.SLOT_ORDERS for o in slot_orders):
        ap.error(f"--orders: give some of {', '.join(store.SLOT_ORDERS)}, got {args.orders!r}")
    if args.tokens < 1 or args.rounds < 1:
        ap.error("--tokens and --rounds must be at least 1")
    if not torch.cuda.is_available():
        print("store_slot_order.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    copy_bw = max(harness.copy_bandwidths(device).values())
    print(f"{torch.cuda.get_device_name(device)}; copy {copy_bw / 1e9:.0f} GB/s, "
          f"{args.tokens} tokens", flush=True)  # fmt: skip
    points = []
    for r in range(args.rounds):
        orders = slot_orders if r % 2 == 0 else slot_orders[::-1]
        for label in labels:
            build, goal = STORES[label]
            for order in orders:
                (row,) = store.run(build(device, (args.tokens,), order), device, copy_bw)
                point = {"store": label, "order": order, "round": r + 1, "goal": goal,
                         "us": row.graph_us, "x_copy": row.bw_ratio,
                         "floor_us": row.floor_graph_us, "floor_x_copy": row.floor_bw_ratio,
                         "correct": row.correct, "variant": row.variant}  # fmt: skip
                points.append(point)
                floor = "" if row.floor_bw_ratio is None else f"  floor {row.floor_bw_ratio:.3f}"
                print(f"{label:22} {order:10} round {r + 1}: {row.graph_us:8.2f} us "
                      f"{row.bw_ratio:.3f} of copy{floor}"
                      f"{'' if row.correct else '  WRONG'}", flush=True)  # fmt: skip
    lines = summary(points)
    print("\n".join(lines))
    if args.json:
        doc = {"env": harness.environment(), "copy_GBps": copy_bw / 1e9, "tokens": args.tokens,
               "points": points, "summary": lines}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if all(p["correct"] for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
