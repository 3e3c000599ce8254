"""What ``kvgen bench`` measures, as one document: the environment, the ceilings measured in the
same run (device-to-device copy, bf16 matmul), a row per store op and size, a row per decode
variant, length mix and head count. The CLI prints and plots it; ``--json`` writes it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvgen import registry

if TYPE_CHECKING:
    from kvgen.families import Family


@dataclasses.dataclass
class Bench:
    """What a family's ``bench`` gets: the device, the sizes, the same-run ceilings (the matmul
    rate measured on first use) and the command's options."""

    device: Any
    sizes: list[int]
    copy_bw: float
    latent: int = 512
    group: int = 32
    compare_default: bool = False
    log: Callable[[str], None] = print
    slot_order: str = "random"  # the stores' (``bench.store.SLOT_ORDERS``)
    _matmul: float | None = None

    def matmul(self) -> float:
        """bf16 matmul FLOP/s, measured once."""
        if self._matmul is None:
            from kvgen.bench import decode

            self._matmul = decode.matmul_rate(self.device)
            self.log(f"bf16 matmul 8192^3: {self._matmul / 1e12:.0f} TFLOP/s")
        return self._matmul

    def progress(self, row) -> None:
        self.log(
            f"  {row.variant} tokens={row.num_tokens}: {row.graph_us:.2f} us, "
            f"{row.gbps:.0f} GB/s ({row.bw_ratio:.2f} of copy)"
        )

    def stores(self, cases) -> tuple[str, list]:
        """Time store-like ``cases`` (``bench.store.Case``): the "results" rows."""
        from kvgen.bench import store

        rows = store.run(cases, self.device, self.copy_bw, self.progress, self.compare_default)
        return "results", rows


def ops() -> dict[str, Family]:
    """op label -> the family that benches it, over every family the registry knows."""
    return {op: fam for fam in registry.all_families().values() for op in fam.bench_ops}


def default_ops() -> list[str]:
    return [
        op
        for fam in registry.all_families().values()
        for op in (fam.bench_ops if fam.bench_default is None else fam.bench_default)
    ]


def measure(
    wanted: list[str],
    sizes: list[int],
    *,
    latent: int = 512,
    group: int = 32,
    compare_default: bool = False,
    commit: str | None = None,
    log: Callable[[str], None] = print,
    slot_order: str = "random",
) -> dict:
    """Time the ``wanted`` ops (labels of ``ops()``) on this machine's first GPU; the bench
    document."""
    import torch

    from kvgen.bench import harness
    from kvgen.bench.store import check_slot_order

    check_slot_order(slot_order)  # before minutes of timing
    by_op = ops()
    unknown = sorted(set(wanted) - set(by_op))
    if unknown:
        raise ValueError(f"unknown ops {', '.join(unknown)}; known: {', '.join(by_op)}")
    device = torch.device("cuda")
    env = harness.environment(commit)
    log(f"{env['device']}: measuring the copy ceiling ...")
    copies = harness.copy_bandwidths(device)
    copy_bw = max(copies.values())
    for how, bw in copies.items():
        log(f"  device-to-device copy, {how}: {bw / 1e9:.0f} GB/s (read + write)")
    bench = Bench(device, sizes, copy_bw, latent, group, compare_default, log, slot_order)
    # the document's sections: "results" (stores and readers), "decode" (MLA), and any other a
    # family's bench names (e.g. "gqa")
    sections: dict[str, list] = {"results": [], "decode": []}
    for op in by_op:  # in the registry's order, whatever the order asked
        if op in wanted:
            section, rows = by_op[op].bench(op, bench)
            sections.setdefault(section, []).extend(rows)
    return {
        "env": env,
        "slot_order": slot_order,
        "copy_bandwidth_GBps": copy_bw / 1e9,
        "copy_bandwidths_GBps": {k: v / 1e9 for k, v in copies.items()},
        "matmul_TFLOPs": None if bench._matmul is None else bench._matmul / 1e12,
        **{name: [asdict(r) for r in rows] for name, rows in sections.items()},
    }


def parse_ops(text: str | None) -> list[str]:
    """The op labels of a comma-separated list (None: ``default_ops()``); a ValueError names
    unknown ones."""
    if text is None:
        return default_ops()
    wanted = [o.strip() for o in text.split(",") if o.strip()]
    unknown = sorted(set(wanted) - set(ops()))
    if unknown:
        raise ValueError(f"unknown ops {', '.join(unknown)}; known: {', '.join(ops())}")
    return wanted


def write_json(doc: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def all_correct(doc: dict) -> bool:
    rows = [r for v in doc.values() if isinstance(v, list) for r in v if isinstance(r, dict)]
    return all(r["correct"] for r in rows if "correct" in r)
