"""How the command line prints: consoles with markup off, errors, JSON, and the tables of
every result kind, each declared as a list of columns.

Markup is off everywhere: names, paths and error messages (with their [brackets]) print as
they are; styles come from ``Text`` objects only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable, Iterable
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

err = Console(stderr=True, soft_wrap=True, markup=False, highlight=False)


def out(wide: bool = False) -> Console:
    """stdout: tables at their full width when stdout is not a terminal (a file, a pipe) or
    with --wide, so that no name or value is cut."""
    if wide or not sys.stdout.isatty():
        return Console(width=100_000, markup=False, highlight=False)
    return Console(markup=False, highlight=False)


def error(message: object) -> None:
    """Print ``error: message`` to stderr."""
    err.print(Text.assemble(("error: ", "bold red"), str(message)))


def print_json(doc: object) -> None:
    """JSON on stdout; non-finite numbers (an infinite error) as null."""

    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    print(json.dumps(clean(doc), indent=2, sort_keys=True, allow_nan=False))


def ok(correct: bool) -> Text:
    return Text("yes") if correct else Text("NO", "bold red")


def _fixed(digits: str) -> Callable[[float], str]:
    return lambda v: format(v, digits)


#: how each field of a result row prints: (header, the cell's text, right-aligned)
FIELDS: dict[str, tuple[str, Callable[[Any], str | Text], bool]] = {
    # kvgen verify
    "name": ("variant", str, False),
    "passed": ("result", lambda p: Text("pass", "green") if p else Text("FAIL", "bold red"), False),
    "mismatched": ("mismatched", str, True),
    "max_error": ("max error", _fixed(".3g"), True),
    "detail": ("detail", str, False),
    # kvgen bench
    "variant": ("variant", str, False),
    "num_tokens": ("tokens", str, True),
    "lengths": ("lengths", str, False),
    "heads": ("heads", str, True),
    "graph_us": ("graph us", _fixed(".2f"), True),
    "default_graph_us": ("default us", _fixed(".2f"), True),
    "eager_us": ("eager us", _fixed(".2f"), True),
    "gbps": ("GB/s", _fixed(".0f"), True),
    "tflops": ("TFLOP/s", _fixed(".0f"), True),
    "bw_ratio": ("x copy BW", _fixed(".3f"), True),
    "floor_bw_ratio": ("floor x copy BW", lambda v: "" if v is None else f"{v:.3f}", True),
    "mm_ratio": ("x matmul", _fixed(".3f"), True),
    "copy_graph_us": ("copy us", _fixed(".2f"), True),
    "latency_ratio": ("x copy time", _fixed(".2f"), True),
    "correct": ("ok", ok, True),
    "kv_format": ("cache", str, False),
    "vs_bf16": ("x bf16 time", lambda v: "" if v is None else f"{v:.2f}", True),
    # kvgen verify --accuracy
    "format": ("format", str, False),
    "bytes_per_token": ("bytes / token", str, True),
    "out_rel_err": ("out rel. error", _fixed(".2e"), True),
    "lse_max_err": ("lse max error", _fixed(".2e"), True),
    # kvgen show
    "bucket": ("bucket", str, False),
    "meta": ("meta", lambda m: " ".join(f"{k}={v}" for k, v in sorted(m.items())), False),
    "time_us": ("us", _fixed(".2f"), True),
    "default_time_us": ("default us", _fixed(".2f"), True),
    "speedup": ("speedup", _fixed(".2f"), True),
    "used": ("used", lambda u: "yes" if u else "", False),
}


def table(title: str, keys: Iterable[str], rows: Iterable[dict]) -> Table:
    """A table of ``rows`` (dicts) with a column per key (``FIELDS`` says how it prints)."""
    keys = list(keys)
    t = Table(title=title)
    for key in keys:
        header, _, right = FIELDS[key]
        t.add_column(header, justify="right" if right else "left")
    for r in rows:
        t.add_row(*(FIELDS[k][1](r[k]) for k in keys))
    return t


def verify_table(title: str, results: Iterable) -> Table:
    keys = ("name", "passed", "mismatched", "max_error", "detail")
    return table(title, keys, (dataclasses.asdict(r) for r in results))


def accuracy_table(rows: list[dict]) -> Table:
    """The accuracy rows pivoted: a line per format, a column per data set."""
    t = Table(title="quantize -> dequantize: SNR dB (max |error| / row absmax)")
    data = list(dict.fromkeys(r["data"] for r in rows))
    for header in ("format", *data):
        t.add_column(header, justify="left" if header == "format" else "right")
    for fmt in dict.fromkeys(r["format"] for r in rows):
        cells = {r["data"]: r for r in rows if r["format"] == fmt}
        t.add_row(
            fmt, *(f"{cells[d]['snr_db']:.1f} ({cells[d]['max_err_amax']:.3f})" for d in data)
        )
    return t


def mla_accuracy_table(rows: list[dict]) -> Table:
    title = "MLA decode over each cache format against the bf16 cache (576/512, 16 heads)"
    return table(title, ("format", "bytes_per_token", "out_rel_err", "lse_max_err"), rows)


def gqa_accuracy_table(rows: list[dict]) -> Table:
    title = (
        "GQA decode over each per-token-head cache format against the bf16 cache "
        "(8 KV heads x 128, 32 query heads)"
    )
    return table(title, ("format", "bytes_per_token", "out_rel_err", "lse_max_err"), rows)


STORE_KEYS = (
    "variant",
    "num_tokens",
    "graph_us",
    "eager_us",
    "gbps",
    "bw_ratio",
    "floor_bw_ratio",
    "copy_graph_us",
    "latency_ratio",
    "correct",
)
DECODE_KEYS = (
    "variant",
    "lengths",
    "heads",
    "bytes_per_token",
    "graph_us",
    "gbps",
    "tflops",
    "bw_ratio",
    "mm_ratio",
    "vs_bf16",
    "correct",
)
GQA_DECODE_KEYS = (
    "kv_format",
    "variant",
    "lengths",
    "heads",
    "bytes_per_token",
    "graph_us",
    "gbps",
    "bw_ratio",
    "vs_bf16",
    "correct",
)
SHOW_KEYS = ("variant", "bucket", "meta", "time_us", "default_time_us", "speedup", "used")


def print_bench(doc: dict, console: Console, compare_default: bool) -> None:
    copy, mm = doc["copy_bandwidth_GBps"], doc["matmul_TFLOPs"]
    if doc["results"]:
        keys = list(STORE_KEYS)
        if compare_default:
            keys.insert(3, "default_graph_us")
        slots = doc.get("slot_order", "random")  # (documents from before the option: random)
        title = f"kvgen bench on {doc['env']['device']} (copy {copy:.0f} GB/s, {slots} slots)"
        console.print(table(title, keys, doc["results"]))
        console.print("goals: x copy BW >= 0.85 at 65536 tokens; x copy time <= 1.2 at 1-16 tokens")
    if doc["decode"]:
        title = f"MLA decode, batch 128, page 64 (copy {copy:.0f} GB/s, matmul {mm:.0f} TFLOP/s)"
        console.print(table(title, DECODE_KEYS, doc["decode"]))
        console.print(
            "goals: heads <= 32 >= 0.80 x copy BW; heads 128 >= 0.50 x matmul; "
            "mixed within 10% of equal"
        )
    if doc.get("gqa"):
        title = f"GQA decode, 8 KV heads x 128, block 16 (copy {copy:.0f} GB/s)"
        console.print(table(title, GQA_DECODE_KEYS, doc["gqa"]))
        console.print(
            "goals: every format >= 0.85 x copy BW in its own bytes (int8 / fp8 <= 0.55x, "
            "int4 C32 <= 0.32x the bf16 cache's time)"
        )


def show_table(doc: dict) -> Table:
    """One tuned-config file (a ``configs.summary`` entry) as a table."""
    prov, env = doc["provenance"], doc["env"]
    title = f"{doc['file']} ({env['device']}, {prov['sampler']}, {prov['date']})"
    t = table(title, SHOW_KEYS, doc["rows"])
    adopted = [r for r in doc["rows"] if r.get("adopted")]
    if adopted:  # configs another run found faster (benchmarks/adopt_faster.py)
        sources = sorted({str(r["adopted"].get("from", "?")) for r in adopted})
        hold = "entry holds" if len(adopted) == 1 else "entries hold"
        t.caption = (
            f"{len(adopted)} {hold} another run's config, timed faster than this run's in one "
            f"process ('adopted' in the file; {', '.join(sources)}): "
            + "; ".join(f"{r['variant']} @ {r['bucket']}" for r in adopted)
        )
    return t
