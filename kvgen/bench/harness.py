"""Timing on the GPU: CUDA graphs, rotated buffers, medians, same-run ceilings."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
from collections.abc import Callable

import torch

import kvgen
from kvgen._math import cdiv

L2_ROTATE_BYTES = 512 << 20  # rotate buffers until a pass touches this much (> 8x a 60 MiB L2)


def sets_for(bytes_per_set: int, most: int = 64) -> int:
    """How many buffer sets to rotate so that one pass over them spills the L2 (two under
    Triton's interpreter, which has no cache to spill and fills each set slowly)."""
    from kvgen.runtime import interpreter_enabled

    if interpreter_enabled():
        return 2
    return max(2, min(most, cdiv(L2_ROTATE_BYTES, max(1, bytes_per_set))))


SETTLE_MS = 50.0


def graph_time_us(
    step: Callable[[int], None],
    n_sets: int,
    calls: int | None = None,
    replays: int = 20,
    trials: int = 7,
    settle_ms: float = SETTLE_MS,
) -> float:
    """Median time per call of ``step(i)`` (i cycling over the sets) replayed in one CUDA graph.

    Before the timed trials the graph replays for ``settle_ms`` of GPU time, so that each
    measurement starts from the clocks its own load settles at, not from those that the previous
    measurement left (a heavy kernel timed right after a lighter one read 5-10 % faster for its
    first few milliseconds on the H200).
    """
    calls = calls or max(n_sets, 32)
    for i in range(n_sets):  # compile and warm up outside the capture
        step(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for k in range(calls):
                step(k % n_sets)
    torch.cuda.current_stream().wait_stream(stream)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    once_ms = start.elapsed_time(end)
    for _ in range(min(10_000, int(settle_ms / max(once_ms, 1e-3)))):
        graph.replay()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(trials):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1e3 / (replays * calls))
    del graph
    return statistics.median(per_call)


def eager_time_us(step: Callable[[int], None], n_sets: int, iters: int = 200) -> float:
    """Median-of-5 time per eager call, launch overhead included (what an unfused caller pays)."""
    for i in range(n_sets):
        step(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(5):
        start.record()
        for k in range(iters):
            step(k % n_sets)
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(out)


def copy_step(nbytes: int, device) -> tuple[Callable[[int], None], int]:
    """A step that copies ``nbytes`` device-to-device (reads + writes = 2 * nbytes), rotated."""
    nbytes = max(16, nbytes // 16 * 16)
    n_sets = sets_for(2 * nbytes)
    src = [
        torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device) for _ in range(n_sets)
    ]
    dst = [torch.empty_like(s) for s in src]

    def step(i: int) -> None:
        dst[i].copy_(src[i])

    return step, n_sets


def warm_up(device, seconds: float = 1.0) -> None:
    """Keep the GPU busy for a while so clocks leave their idle state before anything is timed."""
    import time

    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def copy_bandwidths(device, nbytes: int = 2 << 30) -> dict[str, float]:
    """Device-to-device copy bandwidth in bytes/s (bytes read plus bytes written), three ways.

    torch's ``copy_`` (a memcpy), torch's elementwise clone of fp32 into a preallocated output,
    and a plain Triton copy kernel with 16-byte accesses. The ceiling kvgen reports against is the
    fastest of the three: the strictest yardstick.
    """
    import triton

    from kvgen.bench._copy_kernel import copy_kernel

    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    n = src.numel()
    warm_up(device)

    def triton_copy(i: int) -> None:
        copy_kernel[(triton.cdiv(n, 8192),)](src, dst, n, BLOCK=8192, num_warps=8)

    steps = {
        "torch_copy": lambda i: dst.copy_(src),
        "torch_mul_out": lambda i: torch.mul(src, 1.0, out=dst),
        "triton_copy": triton_copy,
    }
    out = {}
    for name, step in steps.items():
        t = graph_time_us(step, 1, calls=4, replays=10)
        out[name] = 2 * nbytes / (t * 1e-6)
    if not torch.equal(dst, src):
        raise RuntimeError("copy kernel produced a wrong result")
    torch.cuda.empty_cache()
    return out


def copy_bandwidth(device) -> float:
    return max(copy_bandwidths(device).values())


def environment(commit: str | None = None) -> dict:
    import triton

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if commit is None:
        commit = os.environ.get("KVGEN_COMMIT")
    if commit is None:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "capability": f"sm{props.major}{props.minor}",
        "kvgen": kvgen.__version__,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "commit": commit,
    }
