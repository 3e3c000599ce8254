"""A tuning run: the studies of a plan (``kvgen.tune.plan``) on N GPU workers, one worker
process per GPU and one GPU being one worker of the same path; then each study's best configs
re-timed (the confirmation step) and the JSON written once, from the stored studies.

Trials run in the workers, never in this process: a candidate that breaks its GPU context
ends its worker only (the trial is failed, and a fresh worker takes the GPU).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvgen import configs
from kvgen.tune import MIN_GAIN, PATIENCE, SAMPLER, parallel, tuner
from kvgen.tune.plan import Study


class Incomplete(RuntimeError):
    """The workers of a GPU died and were not replaced (a Python error, restarts spent): the
    JSON written holds the studies finished; the same command resumes the others."""


@dataclasses.dataclass(frozen=True)
class Options:
    arch: str
    storage: str | None = None  # a database URL or a journal file; None: the default journal
    sampler: str = SAMPLER
    trials: int = 40
    timeout: float | None = None  # wall-clock seconds for the whole run
    jobs: int = 0  # compile processes (0: default_compile_jobs(); 1: no precompilation)
    confirm: int = 3  # re-time each study's best N configs (0: keep the best single trial)
    out: Path | None = None  # tuned_configs folder (None: the package's)
    patience: int = PATIENCE  # end a study after this many trials without a gain (0: never)
    min_gain: float = MIN_GAIN
    # compile beside the workers (compile only, no launch) rather than before them
    compile_beside: bool = True
    # write into <out>/<arch>/<this GPU's device folder>/ (None: where that folder exists)
    per_device: bool | None = None

    @property
    def stop(self) -> tuner.StopRule:
        """The studies' stop rule (a grid runs whole)."""
        if self.sampler == "grid":
            return tuner.NO_STOP
        return tuner.StopRule(self.patience, self.min_gain, local=self.sampler == "local")


def default_compile_jobs() -> int:
    """``--jobs`` by default: half the CPUs this process may run on (at least 1). The compile
    pool beside the workers then has one process fewer. Its throughput barely grows past that
    (an H100 host of 16 CPUs: 6.5 candidates a second with 6 processes, 7.0 with 14), while
    the worker's own host work (its compiles, launches, graph captures: what its trials wait
    on) slowed 1.4-2x with 14 beside it, at a lower CPU priority than the worker's as they
    are."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        cpus = os.cpu_count() or 2
    return max(1, cpus // 2)


def default_storage(arch: str) -> Path:
    from kvgen.codegen.render import cache_root

    return cache_root() / "tune" / f"{arch}.journal"


def describe(r: tuner.StudyResult, label: str) -> str:
    """One line about a study's result."""
    speedup = (r.default_time_us / r.time_us) if r.meta and r.default_time_us else None
    return (
        f"  {label}: best {r.time_us and round(r.time_us, 2)} us {r.meta} "
        f"(default {r.default_time_us and round(r.default_time_us, 2)} us"
        f"{f', x{speedup:.2f}' if speedup else ''}; {r.trials} trials"
        f"{' (stopped: no more gain)' if r.stopped_early else ''}, {r.failed} failed"
        f"{f', {r.skipped} skipped by constraints' if r.skipped else ''}"
        f"{f'; medians of {r.confirm_rounds} re-timings' if r.confirm_rounds else ''})"
    )


def start(
    names: list[str] | None,
    opts: Options,
    gpus: int = 0,
    log: Callable[[str], None] = print,
    **filters,
) -> list[Path]:
    """``kvgen tune``: plan the studies of ``names`` (default: every family's default
    variants; ``filters``: ``plan``'s families, num_tokens, num_heads, where) and run them on
    ``gpus`` GPUs (0: every visible one). A ValueError says what is
    wrong with the request (unknown names, more GPUs than visible) before anything runs."""
    from kvgen.bench import harness
    from kvgen.tune.plan import plan

    try:
        studies = plan(names, opts.arch, **filters)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
    if not studies:
        asked = ", ".join(f"{k}={v}" for k, v in filters.items() if v) or "no filters"
        raise ValueError(f"nothing to tune: no bucket of the variants asked for passes the "
                         f"filters ({asked})")  # fmt: skip
    devices = parallel.visible_devices()
    if gpus > len(devices):
        raise ValueError(f"--gpus {gpus}, but {len(devices)} GPU(s) are visible")
    return run(studies, devices[: gpus or len(devices)], opts, harness.environment(), log=log)


def run(
    studies: list[Study],
    devices: list[str],
    opts: Options,
    env: dict,
    log: Callable[[str], None] = print,
) -> list[Path]:
    """Tune ``studies`` on ``devices`` (CUDA_VISIBLE_DEVICES entries); returns the JSON files
    written. KeyboardInterrupt propagates once the workers have stopped (nothing is written;
    the studies resume); ``Incomplete`` after the JSON is written, where a GPU's worker died
    for good."""
    from kvgen._resources import tuned_configs_dir

    storage_path = opts.storage or str(default_storage(opts.arch))
    store = tuner.storage_from(opts.storage, Path(storage_path))
    start = time.monotonic()
    deadline = None if opts.timeout is None else start + opts.timeout
    stop = opts.stop
    log(
        f"tuning {len(studies)} studies, {opts.trials} trials each"
        + (
            f" at most (a study ends after {stop.patience} trials in a row without a "
            f"{stop.min_gain:.0%} gain)"
            if stop.patience
            else ""
        )
        + f", sampler {opts.sampler}, on {len(devices)} GPU(s)"
    )
    compile_jobs = opts.jobs if opts.jobs > 0 else default_compile_jobs()
    beside = None  # (the compile pool that runs beside the workers, and its cancel)
    finished = None  # a file naming the variants whose studies are all done (the pool's skips)
    if compile_jobs > 1 and opts.compile_beside:
        # the Triton cache on disk is shared by the workers of this host: what the pool has
        # compiled when a trial comes, the trial loads
        cancel = threading.Event()
        finished = os.path.join(tempfile.mkdtemp(prefix="kvgen-tune-"), "finished-variants")
        pool = threading.Thread(
            target=_precompile, args=(studies, store, opts, compile_jobs, log),
            kwargs={"cancel": cancel, "finished": finished}, name="kvgen-compile", daemon=True,
        )  # fmt: skip
        pool.start()
        beside = (pool, cancel)
    elif compile_jobs > 1:
        t_compile = time.monotonic()
        _precompile(studies, store, opts, compile_jobs, log, deadline)
        log(f"compiling ahead took {time.monotonic() - t_compile:.1f} s")
    for st in studies:  # before any worker starts: see tuner.open_study
        tuner.open_study(
            st.spec, st.bucket, st.space, storage=store, sampler=opts.sampler, n_trials=opts.trials
        )
    plan = parallel.Plan(
        jobs=[(st.spec, st.bucket) for st in studies],
        storage=storage_path,
        sampler=opts.sampler,
        n_trials=opts.trials,
        deadline=None if deadline is None else time.time() + (deadline - time.monotonic()),
        stop=stop,
        confirm=opts.confirm,
    )
    t0 = time.monotonic()
    progress = Progress(studies, store, opts, len(devices), log, finished=finished)
    try:
        exits = parallel.run_workers(plan, devices, log=log, on_poll=progress.poll)
    finally:
        if beside is not None:  # the trials are over: what is left uncompiled is not needed
            beside[1].set()
            beside[0].join()
            shutil.rmtree(os.path.dirname(finished), ignore_errors=True)
    dead = [e for e in exits if e.returncode != 0]
    replaced = sum(len(e.deaths) for e in exits)
    log(
        f"workers done in {time.monotonic() - t0:.1f} s"
        + (f"; {replaced} replaced after a fault or crash" if replaced else "")
        + (f"; {len(dead)} died (re-run to resume)" if dead else "")
    )
    factory = parallel.evaluator_factory(plan)
    results: dict[str, list] = {}
    for i, st in enumerate(studies, 1):
        r = tuner.load_result(st.spec, st.bucket, store, stop)
        if r is None:
            continue
        if r.meta is not None and opts.confirm > 0:
            # re-timed by the worker that finished the study, or (a study finished by an
            # earlier run, or whose worker died or ran out of time) here
            done = tuner.stored_confirmation(st.spec, st.bucket, store, stop)
            if done is not None:
                r = done
            elif deadline is None or time.monotonic() < deadline:
                evaluate = factory(st.spec, st.bucket)
                r = tuner.confirm(st.spec, st.bucket, store, evaluate, top=opts.confirm,
                                  stop=stop)  # fmt: skip
        log(describe(r, f"[{i}/{len(studies)}] {st.spec.name} @ {tuner.bucket_key(st.bucket)}"))
        results.setdefault(st.spec.family, []).append(r)
    written = []
    out = opts.out or tuned_configs_dir()
    device = configs.device_folder(str(env.get("device", "")))
    per_device = opts.per_device
    if per_device is None:  # (the loader reads that folder first on this GPU model)
        per_device = bool(device) and (out / opts.arch / device).is_dir()
    for family, rs in results.items():
        if not any(r.meta is not None for r in rs):  # (e.g. --timeout spent before any trial)
            log(f"{family}: no study has a result yet, nothing written (re-run to resume)")
            continue
        path = tuner.write_results(
            out, opts.arch, family, rs, env, opts.sampler, opts.trials,
            device if per_device else "",
        )  # fmt: skip
        log(f"wrote {path}")
        written.append(path)
    left = 0  # studies not done, where a GPU's worker died for good
    if dead:  # (the progress display holds each study's budget)
        left = sum(
            not tuner.study_done(st.spec, st.bucket, store, limit, stop)
            for st, limit in zip(studies, progress.limits, strict=True)
        )
    if left:  # (a worker that died past the last study left nothing undone)
        raise Incomplete(
            f"the worker of {len(dead)} GPU(s) died ("
            + ", ".join(f"GPU {e.device}: {parallel.death(e.returncode)}" for e in dead)
            + f"); {left} of {len(studies)} studies are not done: the same command resumes them"
        )
    return written


class Progress:
    """A line every ``every_s`` seconds while the workers run: studies done, the study now
    being tuned (the first unfinished one: every worker walks the list in order), and the time
    left over the GPUs. A study left is estimated from what the tuned configs of this arch in
    use (``kvgen.configs``) recorded it cost when they were tuned (``tune_s``), times how this
    run's finished studies compare with what they recorded; a study with no record, from how
    long the finished studies of its family took (the wall time their workers recorded, inputs
    and re-timing included; else their trials' timestamps in storage), and a family with no
    finished study yet counts as the slowest family so far (the decodes, whose trials cost the
    most, come last). With ``finished`` (a file), each line also writes there the variants
    whose studies are all done, which the compile pool then skips."""

    def __init__(
        self, studies, store, opts: Options, gpus: int, log, every_s: float = 20.0, finished=None
    ):
        self.studies, self.store, self.gpus, self.log = studies, store, max(1, gpus), log
        # (a file: each line the variants whose studies are all done, for the compile pool)
        self.finished, self.written = finished, set()
        self.stops = [opts.stop.for_study(st.spec, st.bucket, st.space) for st in studies]
        self.limits = [
            tuner.budget(st.space, opts.sampler, opts.trials, st.spec, st.bucket) for st in studies
        ]
        self.every_s = every_s
        self.start = time.monotonic()
        self.last = self.start
        self.priors = recorded_costs(studies, opts.arch)
        self.second_pass = opts.sampler == "local"  # (the workers' ``tuner.revisit``)

    def poll(self) -> None:
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            self.log(self.line())

    def line(self) -> str:
        done, seconds, left = [], {}, []
        ran, recorded = 0.0, 0.0  # the finished studies with a record: this run's, the record's
        for st, limit, prior, stop in zip(
            self.studies, self.limits, self.priors, self.stops, strict=True
        ):
            study = tuner.load_study(st.spec, st.bucket, self.store)
            trials = [] if study is None else study.get_trials(deepcopy=False)
            finished = tuner.finished(trials)
            if tuner.done(trials, limit, stop):
                done.append(st)
                wall = tuner.wall_time(study)
                stamps = [t for t in finished if t.datetime_start and t.datetime_complete]
                if wall is None and stamps:
                    span = max(t.datetime_complete for t in stamps) - min(
                        t.datetime_start for t in stamps
                    )
                    wall = span.total_seconds()
                if wall is not None:
                    seconds.setdefault(st.spec.family, []).append(wall)
                    if prior is not None:
                        ran, recorded = ran + wall, recorded + prior
            else:
                left.append((st, len(finished) / max(1, limit), prior))
        if self.finished is not None:
            from kvgen.tune import precompile

            names = {st.spec.name for st in done} - {st.spec.name for st, *_ in left}
            if names != self.written:
                precompile.write_finished_variants(self.finished, names)
                self.written = names
        elapsed = time.monotonic() - self.start
        text = f"progress: {len(done)}/{len(self.studies)} studies done in {elapsed / 60:.1f} min"
        if left:
            st = left[0][0]
            text += f"; now {st.spec.name} @ {tuner.bucket_key(st.bucket)}"
        if not left and self.second_pass:
            text += (
                "; the second pass: each study runs the bests its neighbours and sibling "
                "variants found later"
            )
        if left and (seconds or all(prior is not None for *_, prior in left)):
            mean = {f: sum(ss) / len(ss) for f, ss in seconds.items()}
            slowest = max(mean.values(), default=0.0)
            pace = ran / recorded if recorded > 0 else 1.0
            eta = sum(
                (prior * pace if prior is not None else mean.get(st.spec.family, slowest))
                * (1 - frac)
                for st, frac, prior in left
            )
            text += f"; about {eta / self.gpus / 60:.1f} min left"
        return text


def recorded_costs(studies, arch: str) -> list[float | None]:
    """Each study's ``tune_s`` in the tuned configs of ``arch`` in use (what it cost when they
    were tuned), or None: no record, or no readable file."""
    tables: dict[str, dict] = {}
    out = []
    for st in studies:
        family = st.spec.family
        if family not in tables:
            tables[family] = configs.table(arch, family)
        entry = (
            tables[family].get(configs.tuned_name(st.spec), {}).get(tuner.bucket_key(st.bucket), {})
        )
        cost = entry.get("tune_s")
        out.append(float(cost) if isinstance(cost, (int, float)) and cost > 0 else None)
    return out


def _precompile(
    studies, store, opts, compile_jobs, log, deadline=None, cancel=None, finished=None
) -> None:
    """Compile, in ``compile_jobs`` processes before the workers start, what the studies'
    searches visit first (``kvgen.tune.precompile``): every variant with a study left to run
    (a resumed run skips the finished ones), its start points and their neighbourhood. Half of
    the wall-clock budget at most (``deadline``: time.monotonic()): what is left uncompiled
    then compiles in the trials that need it. With ``cancel`` (a threading.Event), beside the
    workers instead: ``compile_jobs - 1`` processes (a core stays the worker's) compile
    without launching anything (no kernel of theirs runs beside a timing), ring after ring
    out to the whole space, until the event is set, skipping the variants that ``finished`` (a
    file the progress monitor writes) names: their studies are all done."""
    from kvgen.tune import precompile

    by_variant: dict[str, list[Study]] = {}
    for st in studies:
        by_variant.setdefault(st.spec.name, []).append(st)
    tuned_at = {(st.spec.name, tuner.bucket_key(st.bucket)) for st in studies}
    entries = []
    for mine in by_variant.values():
        spec, space = mine[0].spec, mine[0].space
        left = [
            st
            for st in mine
            if not tuner.study_done(
                spec, st.bucket, store,
                tuner.budget(space, opts.sampler, opts.trials, spec, st.bucket), opts.stop,
            )
        ]  # fmt: skip
        if not left:
            continue

        def start_points(sts, spec=spec):
            seeds = [spec.default_meta(**st.bucket) for st in sts]
            return seeds + [m for st in sts if (m := tuner.incumbent(spec, st.bucket))]

        siblings = tuner.siblings_of(spec, [other[0].spec for other in by_variant.values()])

        def sibling_points(sts, spec=spec, space=space, siblings=siblings):
            """The tuned JSON's configs of the sibling variants (the same template) at the
            studies' buckets, made to fit: the likely sibling starts (``tuner.warm_start``)."""
            points = []
            for st in sts:
                for other in siblings:
                    if (other.name, tuner.bucket_key(st.bucket)) not in tuned_at:
                        continue
                    meta = tuner.incumbent(other, st.bucket)
                    fit = meta and tuner.nearest_feasible(meta, space, spec, st.bucket)
                    if fit and fit not in points:
                        points.append(fit)
            return points

        full = sum(len(values) - 1 for values in space.params.values())  # every point
        # Beside the workers, the pool goes on ring by ring until the workers are done (its
        # cores are idle otherwise, and a walk past the first rings compiles in its trials:
        # 0.5 s a store kernel, seconds a decode's); before them, the first rings only. With
        # no local walk (tpe, grid, random) any point may come: every ring.
        radius = (
            full if cancel is not None or opts.sampler != "local" else precompile.COMPILE_RADIUS
        )
        # buckets whose launches Triton specialises alike share binaries: each such class's
        # studies' start points and their neighbourhood, compiled at one of its buckets
        classes: dict[tuple, list[Study]] = {}
        for st in left:
            classes.setdefault(precompile.compile_class(st.bucket, space.per_bucket), []).append(st)
        for sts in classes.values():
            bucket = sts[len(sts) // 2].bucket
            entries.append((spec, space, bucket, start_points(sts), radius))
            # the siblings' tuned configs themselves (no ring around them: most studies end
            # at their own start points' neighbourhood)
            entries.append((spec, space, bucket, sibling_points(sts), 0))
    tasks = precompile.plan(entries)
    if cancel is not None:  # beside the workers: compile only, until the trials are over
        # KVGEN_TUNE_COMPILER replaces the GPU compile (the tests' fake one)
        compiler = os.environ.get("KVGEN_TUNE_COMPILER", precompile.DEFAULT_COMPILER)
        log("compiling beside the workers (compile only, no launch):")
        precompile.precompile(tasks, compile_jobs - 1, progress=log, checker=compiler,
                              no_launch=True, cancel=cancel, finished=finished)  # fmt: skip
        return
    stop = None if deadline is None else time.time() + (deadline - time.monotonic()) / 2
    # KVGEN_TUNE_COMPILE_CHECKER replaces the GPU check (the tests' fake one)
    checker = os.environ.get("KVGEN_TUNE_COMPILE_CHECKER", precompile.DEFAULT_CHECKER)
    precompile.precompile(tasks, compile_jobs, progress=log, stop=stop, checker=checker)
