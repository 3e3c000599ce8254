"""A fake evaluator for the multi-process tuner tests: no GPU, a made-up cost per config.

Workers import it as ``_fake_tuning:evaluator`` (the tests put this folder on PYTHONPATH).
Environment knobs: KVGEN_FAKE_LOG (a file: every evaluation appends "pid params" to it),
KVGEN_FAKE_SLEEP (seconds per trial), KVGEN_FAKE_DIE_AT (a trial count: the worker whose
evaluation brings the log to that many lines kills itself with SIGKILL mid-trial, once),
KVGEN_FAKE_FAULT_AT (likewise, but the evaluation raises the error a broken CUDA context gives;
with KVGEN_FAKE_CUDA=1 every evaluation launches a small Triton kernel on the GPU, and that one
writes 4 TiB past its tensor instead, a real illegal address that breaks the CUDA context),
KVGEN_FAKE_BUILD_ERROR (a bucket's num_tokens: building its inputs raises a Python error, in
every process), KVGEN_FAKE_BUILD_OOM ("T:N": the first N builds of the inputs of bucket
num_tokens=T, over all processes, raise torch's CUDA out-of-memory error), KVGEN_FAKE_TRIAL_OOM
("T:N": likewise for the first N evaluations at bucket num_tokens=T), KVGEN_FAKE_OOM_CONFIG (a
config's JSON: every evaluation of it raises that error), KVGEN_FAKE_TRAP ("T:META",
META a config's JSON: at bucket num_tokens=T the cost is 1 at META and otherwise grows with
the parameters that differ from the bucket's default, a local optimum that the local search
does not leave; with KVGEN_FAKE_TRAP_ONLY set to a variant's name, at that variant's studies
only), KVGEN_FAKE_WORKERS
(a count: a worker's first evaluation waits, up to a minute, until that many worker processes
have reached theirs, so that a test of several workers never sees one worker do
all the trials while another is still starting).
"""

import fcntl
import json
import os
import signal
import time

import triton
import triton.language as tl


def environment() -> dict:
    """A tuned file's env block with this process's torch and Triton (the loader ignores a
    file from another Triton)."""
    import torch
    import triton

    return {
        "cuda": "13.0",
        "device": "fake",
        "kvgen": "0.1.0",
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def cost(meta):
    if "rows_per_program" not in meta:  # another family's space: any fixed surface will do
        return 10.0 + sum(abs(v - 2) * (i + 1) for i, v in enumerate(sorted(meta.values())))
    # (warps cost little: the best's neighbours along them are within the tuner's
    # CONFIRM_MARGIN, so the confirmation has configs to re-time)
    return (
        10.0
        + abs(meta["rows_per_program"] - 4) * 3
        + abs(meta["num_warps"] - 2) * 0.2
        + (meta["num_stages"] - 1) * 0.5
    )


def _wait_for_workers(log: str, count: int, timeout: float = 60.0) -> None:
    """Register this process in ``log``.workers, then wait for ``count`` distinct ones."""
    path = log + ".workers"
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(f"{os.getpid()}\n")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path) as f:
            if len(set(f.read().split())) >= count:
                return
        time.sleep(0.05)


@triton.jit
def _poke(x_ptr, offset, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + offset + i, i.to(tl.float32))


def _launch_on_gpu(fault: bool) -> None:
    """A real kernel launch; with ``fault``, one that writes outside every allocation."""
    import torch

    x = torch.zeros(1024, device="cuda")
    _poke[(1,)](x, (1 << 40) if fault else 0, BLOCK=1024)
    torch.cuda.synchronize()


_started = False


def evaluator(spec, bucket):
    log = os.environ.get("KVGEN_FAKE_LOG")
    sleep = float(os.environ.get("KVGEN_FAKE_SLEEP", "0"))
    die_at = int(os.environ.get("KVGEN_FAKE_DIE_AT", "0"))
    fault_at = int(os.environ.get("KVGEN_FAKE_FAULT_AT", "0"))

    workers = int(os.environ.get("KVGEN_FAKE_WORKERS", "0"))
    on_gpu = os.environ.get("KVGEN_FAKE_CUDA") == "1"
    build_fault = os.environ.get("KVGEN_FAKE_BUILD_FAULT")  # a bucket's num_tokens
    if build_fault and log and str(bucket.get("num_tokens")) == build_fault:
        marker = f"{log}.build-fault"
        try:  # the first process to build this bucket's inputs faults there, once
            fd = os.open(marker, os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            pass
        else:
            os.close(fd)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    if str(bucket.get("num_tokens")) == os.environ.get("KVGEN_FAKE_BUILD_ERROR"):
        raise ValueError("a bug in the tuning problem")
    build_oom = os.environ.get("KVGEN_FAKE_BUILD_OOM")
    if build_oom and log and str(bucket.get("num_tokens")) == build_oom.split(":")[0]:
        with open(f"{log}.build-oom", "a+") as f:  # builds of this bucket so far, all processes
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            n = sum(1 for _ in f) + 1
            f.write(f"{os.getpid()}\n")
        if n <= int(build_oom.split(":")[1]):
            import torch

            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.")

    trial_oom = os.environ.get("KVGEN_FAKE_TRIAL_OOM")
    oom_config = json.loads(os.environ.get("KVGEN_FAKE_OOM_CONFIG") or "null")
    trap = os.environ.get("KVGEN_FAKE_TRAP", "")
    trapped = None
    trap_only = os.environ.get("KVGEN_FAKE_TRAP_ONLY")  # a variant's name: the trap is its alone
    if trap_only and spec.name != trap_only:
        trap = ""
    if trap and str(bucket.get("num_tokens")) == trap.split(":", 1)[0]:
        trapped = json.loads(trap.split(":", 1)[1]), spec.default_meta(**bucket)

    def evaluate(meta):
        global _started
        if workers and log and not _started:
            _started = True
            _wait_for_workers(log, workers)
        if meta == oom_config:
            import torch

            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 90.00 GiB.")
        if trial_oom and log and str(bucket.get("num_tokens")) == trial_oom.split(":")[0]:
            with open(f"{log}.trial-oom", "a+") as f:  # evaluations that ran out, all processes
                fcntl.flock(f, fcntl.LOCK_EX)
                f.seek(0)
                n = sum(1 for _ in f) + 1
                if n <= int(trial_oom.split(":")[1]):
                    f.write(f"{os.getpid()} {json.dumps(meta, sort_keys=True)}\n")
            if n <= int(trial_oom.split(":")[1]):
                import torch

                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        if log:
            with open(log, "a+") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                f.seek(0)
                n = sum(1 for _ in f) + 1
                f.write(
                    f"{os.getpid()} {spec.name}@{bucket['num_tokens']} "
                    f"{json.dumps(meta, sort_keys=True)}\n"
                )
                f.flush()
            if n == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if n == fault_at and on_gpu:
                _launch_on_gpu(fault=True)
                raise AssertionError("the faulting kernel ran without a fault")
            if n == fault_at:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if on_gpu:
            _launch_on_gpu(fault=False)
        t0 = time.perf_counter()
        time.sleep(sleep)
        seconds["timing"] += time.perf_counter() - t0
        if trapped is not None:
            best, default = trapped
            return 1.0 if meta == best else 10.0 + sum(meta[k] != default[k] for k in meta)
        return cost(meta)

    seconds = {"timing": 0.0}  # as the GPU evaluator's: where the wall time went
    evaluate.seconds = seconds
    return evaluate


def compile_checker(spec, bucket):
    """``kvgen.tune.precompile``'s checker, faked: every check appends "pid variant#bucket meta" to
    KVGEN_FAKE_LOG; a config of 8 warps is "wrong", one of 16 raises (a compile error); the
    variant named by KVGEN_FAKE_NO_PROBLEM cannot build its problem (out of memory); building
    a problem takes KVGEN_FAKE_BUILD_S seconds and appends "pid variant start end" (times) to
    KVGEN_FAKE_LOG + ".factories"."""
    if spec.name == os.environ.get("KVGEN_FAKE_NO_PROBLEM"):
        raise RuntimeError("CUDA out of memory")
    log = os.environ["KVGEN_FAKE_LOG"]
    t0 = time.time()
    time.sleep(float(os.environ.get("KVGEN_FAKE_BUILD_S", "0")))  # building takes this long
    with open(log + ".factories", "a") as f:  # one line each time a process builds a problem
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(f"{os.getpid()} {spec.name} {t0:.6f} {time.time():.6f}\n")

    def check(meta):
        with open(log, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            where = ",".join(f"{k}={v}" for k, v in bucket.items())
            f.write(f"{os.getpid()} {spec.name}#{where} {json.dumps(meta, sort_keys=True)}\n")
        if meta.get("num_warps") == 16:
            raise RuntimeError("out of resources")
        return meta.get("num_warps") != 8

    return check


def compiler(spec, bucket):
    """``kvgen.tune.precompile``'s compiler (``--compile-beside``), faked: every compile but a
    process's first sleeps KVGEN_FAKE_COMPILE_S seconds first; each appends "pid variant#bucket
    meta nice=N no-launch" to KVGEN_FAKE_LOG + ".compiles" (N: the process's niceness;
    no-launch: whether its Triton launches compile only, as ``precompile.compile_only`` makes
    them)."""
    from triton.runtime import jit

    log = os.environ["KVGEN_FAKE_LOG"] + ".compiles"
    pause = float(os.environ.get("KVGEN_FAKE_COMPILE_S", "0"))
    no_launch = jit.KernelInterface.__getitem__.__name__ == "compile_not_launch"

    done = []

    def compile_(meta):
        if done:
            time.sleep(pause)
        done.append(meta)
        with open(log, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            where = ",".join(f"{k}={v}" for k, v in bucket.items())
            f.write(f"{os.getpid()} {spec.name}#{where} {json.dumps(meta, sort_keys=True)} "
                    f"nice={os.nice(0)} {no_launch}\n")  # fmt: skip
        return True

    return compile_
