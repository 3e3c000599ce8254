"""benchmarks/pool_replay.py over the H100 cold tune of 12-06b (its journal and log, committed)."""

import pytest
from _scripts import BENCHMARKS, benchmark_script

RESULTS = BENCHMARKS / "results" / "sm90"
JOURNAL = RESULTS / "tune-journals" / "tune-cold-h100-2026-12-06b.journal.gz"
LOG = RESULTS / "tune-logs" / "tune-cold-h100-2026-12-06b.log"
pool_replay = benchmark_script("pool_replay")


@pytest.fixture(scope="module")
def replay():
    return pool_replay.Replay(str(JOURNAL), str(LOG))


def test_the_replay_reads_the_run_s_trials_and_the_worker_s_compiles(replay):
    assert replay.logged[0] == 354 and round(replay.logged[1]) == 241  # the log's own figures
    assert len(replay.visits) > 3000  # first-pass trials (the run's 283 studies, ~12 each)
    variants = {name for _, name, _, _ in replay.visits}
    assert len(variants) == 45 and variants <= set(replay.done)
    assert all(0 <= at < 13.2 * 60 for at, *_ in replay.visits)  # before the second pass


def test_ring_by_ring_leaves_the_worker_more_compiles_than_three_rings_a_window(replay):
    """The order the pool had before a window of rings (every entry's start points, then every
    entry's first ring, ...) left the worker more to compile than the window of three in the
    replay, as the H200's cold tune of 12-04c did (545 of the worker's 881 s)."""
    from kvgen.tune import precompile

    now = replay.run(precompile.plan(replay.entries))
    ring_by_ring = replay.run(precompile.plan(replay.entries, window=1))
    assert now[0] < ring_by_ring[0] and now[1] < ring_by_ring[1]
    assert now[0] <= replay.logged[0]  # what the order alone leaves: at most the log's count


def test_the_command_prints_each_order_s_worker_compiles(capsys):
    pool_replay.main([str(JOURNAL), str(LOG)])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("3") and "354 kernels in 241 s" in out[0]
    assert out[1].startswith("current (precompile.plan)") and len(out) == 9
    assert all("worker compiles" in line for line in out[1:])
