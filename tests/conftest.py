import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# No GPU: run the generated kernels in Triton's CPU interpreter. Must be set before any
# generated module is imported (triton.jit picks the interpreter at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests' shared helpers (_fuzz.py) import as top-level modules: --import-mode=importlib puts
# no test folder on sys.path by itself.
sys.path.insert(0, str(Path(__file__).parent))
# pytest-xdist's workers share the machine's cores: each takes its share of torch's CPU threads
# (torch's default, every core in every worker, oversubscribes them: the references and the
# interpreter are CPU work).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (_cores or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
# A fresh module cache per test session, so the generator itself is exercised every run.
os.environ.setdefault("KVGEN_CACHE_DIR", tempfile.mkdtemp(prefix="kvgen-test-cache-"))


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def local_target():
    from kvgen.runtime import local_target

    return local_target()


def pytest_addoption(parser):
    parser.addoption(
        "--shard",
        default=None,
        metavar="K/N",
        help="run only the K-th of N shares of the collected tests (1 <= K <= N): every N-th "
        "test by node id, starting at the K-th, so that each share holds a like mix of the "
        "suite; N calls with K = 1..N run every test once (a suite longer than one "
        "time-limited GPU call spread over several)",
    )


def shard_of(value: str) -> tuple[int, int]:
    """``(k, n)`` from ``--shard``'s ``K/N``; a ValueError naming what was expected."""
    try:
        k, n = (int(x) for x in value.split("/"))
    except ValueError:
        raise ValueError(f"--shard must be K/N with whole numbers, got {value!r}") from None
    if not 1 <= k <= n:
        raise ValueError(f"--shard K/N needs 1 <= K <= N, got {value!r}")
    return k, n


def pytest_collection_modifyitems(config, items):
    value = config.getoption("--shard")
    if not value:
        return
    try:
        k, n = shard_of(value)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    rank = {nodeid: i for i, nodeid in enumerate(sorted(item.nodeid for item in items))}
    keep, drop = [], []
    for item in items:
        (keep if rank[item.nodeid] % n == k - 1 else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
