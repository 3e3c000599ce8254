"""tests/conftest.py's --shard K/N: N shares of the collected tests, each test in exactly one."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = "tests/test_formats.py"  # a file of many quick tests; collected only, never run


def collected(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-p", "no:xdist", *args, TARGET],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def node_ids(proc: subprocess.CompletedProcess) -> list[str]:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_the_shares_cover_every_test_once_and_alike():
    whole = node_ids(collected())
    assert len(whole) >= 9
    shares = [node_ids(collected("--shard", f"{k}/3")) for k in (1, 2, 3)]
    ids = [t for share in shares for t in share]
    assert sorted(ids) == sorted(whole)  # every test in one share, none twice
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    # every third test by node id, from the K-th
    assert sorted(shares[1]) == [t for i, t in enumerate(sorted(whole)) if i % 3 == 1]


def test_a_bad_shard_is_a_usage_error():
    for value, words in (("4/3", "1 <= K <= N"), ("0/2", "1 <= K <= N"), ("a/2", "K/N")):
        proc = collected("--shard", value)
        assert proc.returncode == 4, value  # pytest's usage error
        assert words in proc.stdout + proc.stderr, value
