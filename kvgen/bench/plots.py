"""Pictures of the bench results and the tuned configs (``kvgen bench --plot``, ``kvgen show
--plot``). matplotlib is an optional dependency (``pip install 'kvgen[plot]'``), imported only
here and only when a plot is asked for."""

from __future__ import annotations

import itertools
from pathlib import Path

from kvgen._math import cdiv

_SUFFIX_PARTS = 2  # "-sm90-gpu": the arch and target, the same on every row of one run


def require_matplotlib():
    """matplotlib's pyplot on a file-only backend; a clear error when it is missing."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(
            "plots need matplotlib: pip install 'kvgen[plot]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain_log_ticks(ax) -> None:
    """Log axes labelled with plain numbers (1, 10, 100), no crowded minor labels."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    for axis in (ax.xaxis, ax.yaxis):
        if axis.get_scale() == "log":
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(NullFormatter())


def _short(variant: str) -> str:
    return variant.rsplit("-", _SUFFIX_PARTS)[0]


def bench_plot(doc: dict, path: Path) -> Path:
    """From a ``kvgen bench`` document (its ``--json``): achieved GB/s against tokens for every
    store op with the same run's copy bandwidth drawn, each store's time against its floor's
    (where the document has floors), and the decode's TFLOP/s against query heads with the same
    run's bf16 matmul rate drawn."""
    plt = require_matplotlib()
    stores, decode = doc.get("results") or [], doc.get("decode") or []
    floors = [r for r in stores if r.get("floor_graph_us")]
    have = {"stores": stores, "floors": floors, "decode": decode}
    panels = [p for p in ("stores", "floors", "decode") if have[p]]
    if not panels:
        raise ValueError("the bench document holds no results to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 5.5), squeeze=False)
    device = doc.get("env", {}).get("device", "")
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "stores":
            _stores_panel(ax, stores, doc["copy_bandwidth_GBps"])
        elif panel == "floors":
            _floors_panel(ax, floors)
        else:
            _decode_panel(ax, decode, doc.get("matmul_TFLOPs"))
    commit = (doc.get("env", {}).get("commit") or "")[:12]
    return _save(plt, fig, f"kvgen bench on {device}" + (f" ({commit})" if commit else ""), path)


def _save(plt, fig, title: str, path: Path) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _per_variant(ax, rows: list[dict], y) -> None:
    """A line a variant: ``y(row)`` against its rows' tokens."""
    markers = itertools.cycle("os^vD<>phx*")
    ordered = sorted(rows, key=lambda r: (r["variant"], r["num_tokens"]))
    for variant, group in itertools.groupby(ordered, key=lambda r: r["variant"]):
        group = list(group)
        ax.plot(
            [r["num_tokens"] for r in group],
            [y(r) for r in group],
            marker=next(markers),
            label=_short(variant),
        )


def _stores_panel(ax, rows: list[dict], copy_gbps: float) -> None:
    _per_variant(ax, rows, lambda r: r["gbps"])
    ax.axhline(copy_gbps, color="black", linestyle="--", label=f"copy {copy_gbps:.0f} GB/s")
    ax.set_yscale("log")
    _finish(
        ax,
        ("tokens per call", "GB/s (fewest bytes moved / CUDA-graph time)"),
        "stores and readers against the same run's copy bandwidth",
        "lower right",
    )


def _floors_panel(ax, rows: list[dict]) -> None:
    """Each store's floor time over its own (1: the store moves its bytes as fast as a kernel
    with no arithmetic moves them to the same addresses)."""
    _per_variant(ax, rows, lambda r: r["floor_graph_us"] / r["graph_us"])
    ax.axhline(1.0, color="black", linestyle="--", label="at the floor")
    _finish(
        ax,
        ("tokens per call", "floor time / store time"),
        "stores against their floors (same bytes, same addresses, no format math)",
        "lower right",
    )


def _finish(ax, labels: tuple[str, str], title: str, legend_at: str) -> None:
    """A panel's log2 x axis, labels, title, grid and legend."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel(labels[0])
    ax.set_ylabel(labels[1])
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc=legend_at)
    _plain_log_ticks(ax)


def _decode_panel(ax, rows: list[dict], matmul_tflops: float | None) -> None:
    markers = itertools.cycle("os^vD<>ph")
    key = lambda r: (r["variant"], r["lengths"])  # noqa: E731
    for (variant, lengths), group in itertools.groupby(sorted(rows, key=key), key=key):
        group = sorted(group, key=lambda r: r["heads"])
        label = f"{_short(variant) if variant != 'auto' else 'flash_mla_with_kvcache'}, {lengths}"
        ax.plot(
            [r["heads"] for r in group],
            [r["tflops"] for r in group],
            marker=next(markers),
            label=label,
        )
    if matmul_tflops:
        ax.axhline(
            matmul_tflops,
            color="black",
            linestyle="--",
            label=f"bf16 matmul {matmul_tflops:.0f} TFLOP/s",
        )
    _finish(
        ax,
        ("query heads (seq_len_q 1)", "TFLOP/s"),
        "MLA decode, batch 128, page 64, 576/512 bf16",
        "upper left",
    )


def show_plot(arch: str, docs: list[dict], path: Path) -> Path:
    """From ``kvgen show``'s documents: each tuned entry's time against the template default's
    time at its bucket, one panel per family; points under the diagonal are what tuning
    gained, and the entries the ops use are filled."""
    plt = require_matplotlib()
    if not docs:
        raise ValueError("no tuned configs to plot")
    cols = min(3, len(docs))
    nrows = cdiv(len(docs), cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 5 * nrows), squeeze=False)
    for ax, d in zip(axes.flat, docs, strict=False):
        rows = d["rows"]
        default = [r["default_time_us"] for r in rows]
        tuned = [r["time_us"] for r in rows]
        used = [r["used"] for r in rows]
        ax.scatter(
            [x for x, u in zip(default, used, strict=True) if u],
            [y for y, u in zip(tuned, used, strict=True) if u],
            s=14,
            label="used by the op",
        )
        if not all(used):
            ax.scatter(
                [x for x, u in zip(default, used, strict=True) if not u],
                [y for y, u in zip(tuned, used, strict=True) if not u],
                s=14,
                facecolors="none",
                edgecolors="gray",
                label="not chosen",
            )
        lo, hi = min(default + tuned), max(default + tuned)
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8, label="tuned = default")
        ax.set_xscale("log")
        ax.set_yscale("log")
        speedups = sorted(r["speedup"] for r in rows)
        median = speedups[len(speedups) // 2]
        # (a GPU model's own file beside the arch's: its device folder names the panel)
        name = d["family"] + (f" ({d['device']})" if d.get("device") else "")
        ax.set_title(f"{name}: {len(rows)} entries, median x{median:.2f}", fontsize=10)
        ax.set_xlabel("template default, us")
        ax.set_ylabel("tuned, us")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
        _plain_log_ticks(ax)
    for ax in list(axes.flat)[len(docs) :]:
        ax.set_visible(False)
    title = f"kvgen tuned configs, {arch}: tuned against default time per bucket"
    return _save(plt, fig, title, path)
