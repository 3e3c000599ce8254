"""What ``kvgen tune`` compiles ahead (``kvgen.tune.precompile``): the start points and their
neighbourhood, nearest first across variants, in one pool of processes; with a fake checker."""

import collections
import json
import os
import re
import time

import pytest

from kvgen.families.gqa_decode import GQADecodeSpec
from kvgen.families.mxfp4_mla import StoreMXFP4MLASpec
from kvgen.families.per_token_head import StoreKVPerTokenHeadSpec
from kvgen.space import bucket_key, load_space
from kvgen.tune import precompile

MXFP4 = StoreMXFP4MLASpec(32, 512, "bf16", "paged", "sm90", "gpu")
KV = StoreKVPerTokenHeadSpec("int8", 128, 128, "bf16", "sm90", "gpu")
GQA = GQADecodeSpec(128, 128, "bf16", "int8", 0, "portable", "sm90", "gpu")


def _compile_key(space, m):
    return tuple(v for k, v in m.items() if k not in space.host)


@pytest.mark.parametrize("spec", [MXFP4, KV, GQA], ids=lambda s: s.family)
def test_rings_hold_each_compile_once_at_its_distance_from_the_nearest_start(spec):
    space = load_space(spec.template)
    seeds = [spec.default_meta(**b) for b in space.bucket_list()[:3]]
    full = sum(len(v) - 1 for v in space.params.values())
    rings = space.compile_rings(spec, seeds, full)
    keys = [_compile_key(space, m) for ring in rings for m in ring]
    assert len(keys) == len(set(keys))  # one compile each
    assert set(keys) == {_compile_key(space, m) for m in space.compile_points(spec)}  # all
    distance = {}  # a compile's distance: that of the nearest point sharing it
    for p in space.feasible(spec):
        d = min(space.steps(p, s) for s in seeds)
        k = _compile_key(space, p)
        distance[k] = min(d, distance.get(k, d))
    for r, ring in enumerate(rings):
        assert all(distance[_compile_key(space, m)] == r for m in ring)
    assert {_compile_key(space, s) for s in seeds if not space.violations(spec, s)} == {
        _compile_key(space, m) for m in rings[0]
    }
    near = space.compile_rings(spec, seeds, 1)
    assert near == [rings[0], rings[1]]  # a smaller radius: the same rings, cut
    assert len(near[0]) + len(near[1]) < len(keys)  # and far fewer compiles
    assert space.compile_rings(spec, [{"nonsense": 1}], 2) == [[], [], []]


def test_the_plan_goes_a_window_of_rings_at_a_time_in_study_order_in_small_chunks():
    """Rings 0-2 of the first entry, then of the second, then rings 3-4 of the first, then of
    the second: the first studies' neighbourhoods before the last studies' start points, and
    every entry's near rings before any entry's far ones."""
    variants = []
    for spec in (MXFP4, KV):
        space = load_space(spec.template)
        b = space.bucket_list()
        variants.append((spec, space, b[0], [spec.default_meta(**x) for x in b], 4))
    tasks = precompile.plan(variants, chunk=3, window=3)
    assert all(1 <= len(t.metas) <= 3 for t in tasks)
    entry = {MXFP4.name: 0, KV.name: 1}
    got = [(t.ring // 3, entry[t.spec.name], t.ring) for t in tasks]
    assert got == sorted(got)
    passes = [(w, e) for w, e, _ in dict.fromkeys(got)]
    assert list(dict.fromkeys(passes)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in range(5):  # each ring holds both variants' points at that distance
        names = {t.spec.name for t in tasks if t.ring == r}
        assert names == {MXFP4.name, KV.name}
        for spec, space, _, seeds, _ in variants:
            want = space.compile_rings(spec, seeds, 4)[r]
            got_r = [m for t in tasks if t.ring == r and t.spec == spec for m in t.metas]
            assert got_r == want
    one = precompile.plan(variants, chunk=3, window=1)  # window 1: ring by ring
    assert [t.ring for t in one] == sorted(t.ring for t in one)
    # another order: entry after entry, each out to its last ring
    whole = precompile.plan(variants, chunk=3, order=lambda ring, entry: (entry, ring))
    assert [(entry[t.spec.name], t.ring) for t in whole] == sorted(
        (entry[t.spec.name], t.ring) for t in tasks
    )


def test_a_candidate_two_entries_hold_at_one_bucket_is_compiled_once_in_the_nearer_ring():
    space = load_space(MXFP4.template)
    buckets = space.bucket_list()
    a, b = buckets[0], buckets[-1]
    own = [MXFP4.default_meta(**a)]
    wide = [MXFP4.default_meta(**x) for x in buckets]
    tasks = precompile.plan([(MXFP4, space, a, own, 1), (MXFP4, space, b, wide, 2),
                             (MXFP4, space, a, wide, 2)])  # fmt: skip
    at = {}
    for t in tasks:
        for m in t.metas:
            key = (json.dumps(t.bucket), json.dumps(m, sort_keys=True))
            assert key not in at  # once a bucket
            at[key] = t.ring
    rings_a = space.compile_rings(MXFP4, wide, 2)
    for r, ring in enumerate(rings_a):
        for m in ring:
            mine = space.compile_rings(MXFP4, own, 1)
            near = [i for i, ring_own in enumerate(mine) if m in ring_own]
            assert at[(json.dumps(a), json.dumps(m, sort_keys=True))] == min(near + [r])
    # one window (radius 2): the first entry's rings 0-1 at a, then the second's at b, then
    # what the third adds at a
    where = [json.dumps(t.bucket) for t in tasks]
    first_b = where.index(json.dumps(b))
    assert set(where[:first_b]) == {json.dumps(a)}
    assert [t.ring for t in tasks[:first_b]] == sorted(t.ring for t in tasks[:first_b])
    assert max(t.ring for t in tasks[:first_b]) == 1
    assert {json.dumps(t.bucket) for t in tasks} == {json.dumps(a), json.dumps(b)}


def test_one_pool_compiles_every_task_in_order_and_stops_at_the_deadline(tmp_path, monkeypatch):
    log = tmp_path / "checks.log"
    monkeypatch.setenv("KVGEN_FAKE_LOG", str(log))
    variants = []
    for spec in (MXFP4, KV):
        space = load_space(spec.template)
        b = space.bucket_list()
        variants.append((spec, space, b[len(b) // 2], [spec.default_meta(**x) for x in b], 1))
    space = load_space(MXFP4.template)  # the same candidates at a second bucket: their own
    variants.append((MXFP4, space, space.bucket_list()[0], variants[0][3], 1))
    tasks = precompile.plan(variants)
    lines = []
    out = precompile.precompile(
        tasks, 2, progress=lines.append, checker="_fake_tuning:compile_checker"
    )
    metas = [(t.spec.name, bucket_key(t.bucket), json.dumps(m, sort_keys=True))
             for t in tasks for m in t.metas]  # fmt: skip
    assert sorted(out) == sorted(metas)  # every candidate, once a bucket
    assert len({(name, m) for name, _, m in out}) < len(out)
    assert "left to the trials" not in "".join(lines)
    for (_, _, meta), outcome in out.items():
        warps = json.loads(meta)["num_warps"]
        want = {8: "wrong result", 16: "RuntimeError: out of resources"}.get(warps, "ok")
        assert outcome == want
    checks = log.read_text().splitlines()
    assert {c.split()[1].split("#")[0] for c in checks} == {MXFP4.name, KV.name}
    assert len(checks) == len(metas)
    assert len({c.split()[0] for c in checks}) <= 2  # the same two processes throughout
    built = (tmp_path / "checks.log.factories").read_text().splitlines()
    assert len(built) < len(tasks)  # problems are kept between a process's tasks
    assert any("start points" in x for x in lines) and any("1 step(s)" in x for x in lines)
    summary = next(x for x in lines if x.startswith("  compiled "))
    assert "most process time" in lines[lines.index(summary) + 1] and KV.name in lines[-2]
    # the failures by kind, each with the variants it hit most
    wrong = collections.Counter(name for (name, _, _), v in out.items() if v == "wrong result")
    assert wrong and not any(v.startswith("RuntimeError") for v in out.values())
    named = ", ".join(f"{n} {name}" for name, n in wrong.most_common())
    assert lines[-1] == f"  failed: {wrong.total()} wrong result ({named})"

    log.unlink()
    os.unlink(str(log) + ".factories")
    lines.clear()
    out = precompile.precompile(tasks, 2, progress=lines.append, stop=time.time() - 1,
                                checker="_fake_tuning:compile_checker")  # fmt: skip
    assert out == {} and not log.exists()  # past the deadline: nothing compiles
    assert "left to the trials" in lines[-2]

    # a variant whose studies are all done (the progress monitor's file): its tasks are skipped
    log.unlink(missing_ok=True)
    finished = str(tmp_path / "finished-variants")
    precompile.write_finished_variants(finished, [KV.name])
    lines.clear()
    out = precompile.precompile(tasks, 2, progress=lines.append, finished=finished,
                                checker="_fake_tuning:compile_checker")  # fmt: skip
    assert sorted(out) == sorted(m for m in metas if m[0] == MXFP4.name)
    assert {c.split()[1].split("#")[0] for c in log.read_text().splitlines()} == {MXFP4.name}
    skipped = sum(len(t.metas) for t in tasks if t.spec == KV)
    summary = next(x for x in lines if x.startswith("  compiled "))
    assert f"{skipped} skipped: their variant's studies were done" in summary
    per_ring = [re.search(r"(\d+) skipped \(their variant's studies were done\)", x)
                for x in lines if "from them" in x or "start points" in x]  # fmt: skip
    assert sum(int(m.group(1)) for m in per_ring if m) == skipped  # each ring's line says its own
    assert "left to the trials" not in summary

    monkeypatch.setenv("KVGEN_FAKE_NO_PROBLEM", KV.name)  # a problem that cannot be built
    out = precompile.precompile(tasks, 2, checker="_fake_tuning:compile_checker")
    assert sorted(out) == sorted(metas)  # the pool goes on
    assert all(v.startswith("building the problem: RuntimeError: CUDA out of memory")
               for (name, _, _), v in out.items() if name == KV.name)  # fmt: skip
    assert any(v == "ok" for (name, _, _), v in out.items() if name == MXFP4.name)


def test_the_pool_s_failures_are_counted_by_kind_with_the_variants_they_hit_most():
    room = f"building the problem: {precompile.NoRoom.__name__}: 20% of the GPU's memory free"
    outcome = {
        ("a", "rows=4", "m1"): "ok",
        ("a", "rows=4", "m2"): "wrong result",
        ("b", "rows=4", "m1"): "wrong result",
        ("b", "rows=8", "m1"): "wrong result",
        ("b", "rows=4", "m2"): "PTXASError: ptxas fatal: entry function uses too much shared data",
        ("c", "rows=4", "m1"): "building the problem: OutOfMemoryError: CUDA out of memory.",
        ("d", "rows=4", "m1"): "PTXASError: ptxas error",
        ("e", "rows=4", "m1"): "PTXASError: ptxas error",
        ("a", "rows=4", "m3"): room,  # left to the trials for memory: not a failure
    }
    assert precompile.failure_kinds(outcome) == (
        "3 PTXASError (1 b, 1 d, ...); 3 wrong result (2 b, 1 a); "
        "1 building the problem: OutOfMemoryError (1 c)"
    )
    assert precompile.failure_kinds(outcome, kinds=1) == "3 PTXASError (1 b, 1 d, ...)"
    assert precompile.failure_kinds({("a", "x", "m"): "ok", ("a", "x", "n"): room}) == ""


def test_a_pool_process_builds_a_problem_only_where_the_gpu_keeps_its_reserve_free(
    tmp_path, monkeypatch
):
    """A pool process builds a (variant, bucket)'s problem only while POOL_RESERVE of the GPU's
    memory is free (waiting up to POOL_MEMORY_WAIT_S for it) and drops one whose building took
    the free share below it: the candidates are then left to the trials ("building the
    problem: NoRoom"), so that the pool never takes the memory the worker needs."""
    log = tmp_path / "checks.log"
    monkeypatch.setenv("KVGEN_FAKE_LOG", str(log))
    monkeypatch.setattr(precompile, "POOL_MEMORY_WAIT_S", 1.5)  # (polled every 0.5 s)
    space = load_space(KV.template)
    bucket = space.bucket_list()[0]
    metas = (KV.default_meta(**bucket),)
    task = precompile.Task(KV, bucket, metas, 0)
    key = json.dumps(metas[0], sort_keys=True)
    factories = tmp_path / "checks.log.factories"

    def run(shares):
        free = iter(shares)
        monkeypatch.setattr(precompile, "_free_share", lambda: next(free))
        precompile._checks.clear()
        _, out, _ = precompile._run((task, None, "_fake_tuning:compile_checker", None))
        return out

    low = run([0.1] * 1000)  # never room: nothing built, after the wait
    assert low[key].startswith("building the problem: NoRoom: 10% of the GPU's memory free")
    assert not factories.exists() and not log.exists()
    taken = run([0.5, 0.1])  # room before, none after building: dropped, not checked
    assert taken[key].startswith("building the problem: NoRoom: building it left 10%")
    assert len(factories.read_text().splitlines()) == 1 and not log.exists()
    assert precompile._checks == {}
    waited = run([0.1, 0.2, 0.5, 0.4])  # room after a wait: built, checked
    assert waited == {key: "ok"} and len(log.read_text().splitlines()) == 1
    precompile._checks.clear()


def test_a_pool_process_drops_its_problem_once_the_free_share_falls_under_the_reserve(
    tmp_path, monkeypatch
):
    """Between candidates a pool process looks at the GPU's free memory again: once a worker's
    trial has taken it below POOL_RESERVE, the process drops its problem and leaves the task's
    other candidates to the trials, so that the worker's next try finds the memory."""
    log = tmp_path / "checks.log"
    monkeypatch.setenv("KVGEN_FAKE_LOG", str(log))
    space = load_space(KV.template)
    bucket = space.bucket_list()[0]
    metas = tuple(space.feasible(KV, bucket)[:4])
    keys = [json.dumps(m, sort_keys=True) for m in metas]
    free = iter([0.5, 0.4, 0.3, 0.1])  # room, after building, before the 2nd, before the 3rd
    monkeypatch.setattr(precompile, "_free_share", lambda: next(free))
    precompile._checks.clear()
    task = precompile.Task(KV, bucket, metas, 0)
    _, out, _ = precompile._run((task, None, "_fake_tuning:compile_checker", None))
    assert list(out) == keys
    assert all(not out[k].startswith("building the problem") for k in keys[:2])
    for k in keys[2:]:
        assert out[k].startswith("building the problem: NoRoom: 10% of the GPU's memory free")
    assert len(log.read_text().splitlines()) == 2  # the first two checked, no more
    assert precompile._checks == {}  # and the problem given back


def test_a_pool_s_processes_build_their_problems_one_at_a_time(tmp_path, monkeypatch):
    """Several pool processes that switch problems at once build them one after another, so
    that each one's look at the free memory after building sees the others' problems."""
    log = tmp_path / "checks.log"
    monkeypatch.setenv("KVGEN_FAKE_LOG", str(log))
    monkeypatch.setenv("KVGEN_FAKE_BUILD_S", "0.3")
    space = load_space(KV.template)
    buckets = space.bucket_list()[:3]
    tasks = [precompile.Task(KV, b, (KV.default_meta(**b),), 0) for b in buckets]
    out = precompile.precompile(tasks, 3, checker="_fake_tuning:compile_checker")
    assert len(out) == 3
    lines = (tmp_path / "checks.log.factories").read_text().splitlines()
    assert len(lines) == 3 and len({line.split()[0] for line in lines}) > 1
    built = sorted(tuple(float(x) for x in line.split()[2:4]) for line in lines)
    for (_, end), (start, _) in zip(built, built[1:], strict=False):
        assert start >= end  # no two builds overlap


def test_the_trials_count_compiles_and_cache_hits_through_triton_s_listener(monkeypatch):
    """The worker's log says how many kernels a study compiled and how many it found in
    Triton's cache (what compiling ahead saves): counted by Triton's compilation listener,
    installed once, chained to a listener set before."""
    from triton import knobs

    from kvgen.tune import problems

    seen = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda **kw: seen.append(kw["cache_hit"]))
    monkeypatch.setattr(problems, "COMPILES", {"compiled": 0, "cached": 0})
    monkeypatch.setattr(problems, "COMPILE_SECONDS", [0.0])
    problems.listen_to_compiles()
    listen = knobs.compilation.listener
    problems.listen_to_compiles()  # once: a second call chains nothing more
    assert knobs.compilation.listener is listen
    took = knobs.CompileTimes(ir_initialization=500_000, lowering_stages=[("ptx", 1_000_000)],
                              store_results=0)  # (microseconds)  # fmt: skip
    for hit, times in ((False, took), (True, took), (True, None), (False, None)):
        listen(src=None, metadata={}, metadata_group={}, times=times, cache_hit=hit)
    assert problems.COMPILES == {"compiled": 2, "cached": 2}
    assert problems.COMPILE_SECONDS == [1.5]  # the compiles' time, not the cache hits'
    assert seen == [False, True, True, False]  # the listener before it hears every compile


def test_compile_all_takes_a_benchmark_s_candidates_at_one_bucket(tmp_path, monkeypatch):
    monkeypatch.setenv("KVGEN_FAKE_LOG", str(tmp_path / "checks.log"))
    space = load_space(MXFP4.template)
    metas = space.feasible(MXFP4)
    bucket = space.bucket_list()[2]
    out = precompile.compile_all(MXFP4, bucket, metas, 2, checker="_fake_tuning:compile_checker")
    assert sorted(out) == sorted(
        (MXFP4.name, bucket_key(bucket), json.dumps(m, sort_keys=True)) for m in metas
    )


def test_buckets_fall_into_the_classes_triton_specialises_their_sizes_by():
    cls = precompile.compile_class
    assert cls({"num_tokens": 16}) == cls({"num_tokens": 65536})  # multiples of 16
    assert len({cls({"num_tokens": t}) for t in (1, 4, 16)}) == 3  # one, other, multiple
    # vLLM's inline-scale rows are a class of their own
    a = {"num_tokens": 4096, "num_heads": 8, "row_align": 16}
    assert cls(a) != cls({**a, "row_align": 4}) and cls(a) == cls({**a, "num_tokens": 256})
    # a size the kernels take as a constexpr ([compile] per_bucket) counts by value
    assert cls({"rows": 4}) == cls({"rows": 8}) and cls({"rows": 16}) == cls({"rows": 32})
    assert cls({"rows": 4}, ("rows",)) != cls({"rows": 8}, ("rows",))
    assert cls({"rows": 16, "n": 32}, ("rows",)) == cls({"rows": 16, "n": 64}, ("rows",))


def test_the_gqa_rows_variant_compiles_at_every_bucket_the_portable_one_at_one_a_class(
    monkeypatch,
):
    """The compile pool's plan (``kvgen tune``'s ``_precompile``): the rows variant's G and N
    are constexprs from the bucket's rows and its ROW_ALIGN from its row_align ([compile]
    per_bucket), so each of its buckets is a class of its own; the portable variant's rows 4
    and 8 (and 16 and 32) compile alike."""
    from kvgen.families.gqa_decode import GQADecodeSpec
    from kvgen.space import load_space
    from kvgen.tune import run as tune_run

    rows = GQADecodeSpec(128, 128, "bf16", "int8", 0, "rows", "sm90", "gpu")
    portable = GQADecodeSpec(128, 128, "bf16", "int8", 0, "portable", "sm90", "gpu")
    assert load_space(rows.template).per_bucket == ("rows", "row_align")
    assert load_space(portable.template).per_bucket == ()

    class Study:
        def __init__(self, spec, bucket):
            self.spec, self.space, self.bucket = spec, load_space(spec.template), bucket

    studies = [Study(s, b) for s in (rows, portable) for b in load_space(s.template).bucket_list()]
    captured = []
    monkeypatch.setattr(tune_run.tuner, "study_done", lambda *a, **k: False)
    monkeypatch.setattr(tune_run.tuner, "incumbent", lambda spec, bucket: None)
    monkeypatch.setattr(precompile, "precompile", lambda tasks, *a, **k: captured.extend(tasks))
    tune_run._precompile(studies, None, tune_run.Options("sm90"), 2, log=lambda line: None)
    at = {(t.spec.variant, t.bucket["rows"], t.bucket.get("row_align")) for t in captured}
    assert {(r, a) for v, r, a in at if v == "rows"} == {
        (r, a) for r in (4, 8, 16) for a in (4, 8, 16)
    }
    assert len({r for v, r, _ in at if v == "portable"}) == 2  # one bucket of {4, 8}, {16, 32}


def test_the_pool_also_compiles_the_sibling_variants_tuned_configs(monkeypatch):
    """The compile pool's plan also holds, for each study, the tuned JSON's configs of the
    other variants of its template at its bucket (made to fit), as start points with no ring
    around them: the configs the first pass's sibling starts queue (``tuner.warm_start``)
    where the siblings' studies end at them, compiled ahead instead of in the trials."""
    from kvgen.families.gqa_decode import GQADecodeSpec
    from kvgen.space import load_space
    from kvgen.tune import run as tune_run

    mine = GQADecodeSpec(128, 128, "bf16", "int8", 0, "portable", "sm90", "gpu")
    sibling = GQADecodeSpec(128, 128, "bf16", "fp8e4m3", 0, "portable", "sm90", "gpu")
    space = load_space(mine.template)
    bucket = {"rows": 32}
    default = mine.default_meta(**bucket)
    feasible = space.feasible(mine, bucket)
    far = max(feasible, key=lambda m: space.steps(m, default))
    assert space.steps(far, default) > precompile.COMPILE_RADIUS

    class Study:
        def __init__(self, spec, bucket):
            self.spec, self.space, self.bucket = spec, space, bucket

    captured = []
    monkeypatch.setattr(tune_run.tuner, "study_done", lambda *a, **k: False)

    def incumbent(spec, b):  # the sibling's tuned config at the bucket: ``far``
        return far if spec == sibling and b == bucket else None

    monkeypatch.setattr(tune_run.tuner, "incumbent", incumbent)
    monkeypatch.setattr(precompile, "precompile", lambda tasks, *a, **k: captured.extend(tasks))

    def planned(studies):
        captured.clear()
        tune_run._precompile(studies, None, tune_run.Options("sm90"), 2, log=lambda line: None)
        return {(t.spec.name, space.compile_key(m), t.ring) for t in captured for m in t.metas}

    key = space.compile_key(far)
    assert (mine.name, key, 0) in planned([Study(mine, bucket), Study(sibling, bucket)])
    # no sibling study at the bucket: its tuned config is no start point
    assert not any(n == mine.name and k == key for n, k, _ in planned([Study(mine, bucket)]))


COMPILE_ONLY_SCRIPT = """
import os, sys
import torch, triton, triton.language as tl
from kvgen.tune import precompile, problems

@triton.jit
def ones(x_ptr):
    tl.store(x_ptr + tl.arange(0, 16), tl.full([16], 1.0, tl.float32))

x = torch.zeros(16, device="cuda")
problems.listen_to_compiles()
if sys.argv[1] == "compile-only":
    precompile.compile_only()
ones[(1,)](x)
torch.cuda.synchronize()
print(int(x.sum()), problems.COMPILES["compiled"], problems.COMPILES["cached"])
"""


def test_compile_only_launches_compile_and_run_nothing(tmp_path):
    """On a GPU: after ``precompile.compile_only()``, ``kernel[grid](...)`` compiles (into
    Triton's cache on disk) and leaves its output untouched; a later process's real launch of
    the same kernel finds that binary (a cache hit) and runs it."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("compiling for a GPU and launching need one")
    import subprocess
    import sys

    script = tmp_path / "ones.py"
    script.write_text(COMPILE_ONLY_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")

    def run(mode):
        done = subprocess.run([sys.executable, str(script), mode], env=env, capture_output=True,
                              text=True, check=True)  # fmt: skip
        return [int(x) for x in done.stdout.split()]

    assert run("compile-only") == [0, 1, 0]  # compiled, not run
    assert run("launch") == [16, 0, 1]  # found compiled, run


def test_the_compiler_makes_every_launch_of_a_trial():
    """Beside the workers a candidate is compiled through every launch its trial makes: the
    check's (a decode checks a small batch: its own binary) and the timed run of each input
    set (a decode's sets are batches of other sizes), not only the first set's."""
    calls = []

    def run(i, meta):
        calls.append(("run", i, meta["x"]))

    def check(meta):
        calls.append(("check", meta["x"]))
        return False  # (outputs no kernel wrote: the verdict is not the compiler's)

    compile_ = precompile.trial_launches(run, check, 3)
    assert compile_({"x": 7}) is True
    assert calls == [("check", 7), ("run", 0, 7), ("run", 1, 7), ("run", 2, 7)]


def test_a_candidate_ptxas_cannot_assemble_leaves_its_ptx_out_of_the_log(capsys, monkeypatch):
    """Triton prints a kernel's whole PTX before it raises PTXASError; the tuner's processes
    drop that message (the error it raises keeps ptxas' lines) and print the rest."""
    from triton.backends.nvidia import compiler

    monkeypatch.setattr(compiler, "print", print, raising=False)
    from kvgen.tune.problems import drop_ptx_dumps

    drop_ptx_dumps()
    dump = "\n\n=====\nInternal Triton PTX codegen error\n\n.version 8.7\n=====\n"
    compiler.print(dump + "please share the reproducer above with Triton project.\n")
    compiler.print("ptxas info    : Used 128 registers")
    out = capsys.readouterr().out
    assert ".version" not in out and "codegen error" not in out
    assert "Used 128 registers" in out
