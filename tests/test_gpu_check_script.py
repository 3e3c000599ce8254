"""scripts/gpu_check.sh's bookkeeping, with a stand-in for compute-sanitizer: every (tool,
section) pair runs, the report joins them in order, and a run that reports errors, exits
non-zero or stops short makes the script fail."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STUB = """#!/bin/bash
tool=$2; section=${@: -1}
echo "ran $tool $section"
case "$tool:$section" in
  "$BAD") echo "========= ERROR SUMMARY: 2 errors"; exit 3 ;;
  "$SHORT") exit 0 ;;
esac
if [ "$tool" = racecheck ]; then
  echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
else
  echo "========= ERROR SUMMARY: 0 errors"
fi
"""


# a stand-in for the Python that runs a section without the tool (the warm-up): it logs the
# section; the report's header asks it for torch's and Triton's versions with -c
PY_STUB = """#!/bin/bash
if [ "$1" = -c ]; then echo "torch stub"; exit 0; fi
echo "${@: -1}" >>"$WARM_LOG"
"""


def run(tmp_path, bad="", short="", warm=False):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stubs = (("compute-sanitizer", STUB), ("nvidia-smi", "#!/bin/bash\necho stub\n"))
    stubs += (("python-stub", PY_STUB),)
    for name, text in stubs:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    python = str(bin_dir / "python-stub") if warm else sys.executable
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=python)
    env |= {"BAD": bad, "SHORT": short, "KVGEN_COMMIT": "test"}
    env |= {"KVGEN_SANITIZER_WARM": "1" if warm else "0", "WARM_LOG": str(tmp_path / "warm.log")}
    out = tmp_path / "report.txt"
    sections = ["decodes", "gqa_decodes_int4"]
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts/gpu_check.sh"), str(out), *sections],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, out.read_text()


def test_every_tool_runs_every_section_and_the_report_keeps_their_order(tmp_path):
    proc, report = run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tools = ["memcheck", "initcheck", "synccheck", "racecheck"]
    heads = [line for line in report.splitlines() if line.startswith("###")]
    assert heads == [
        f"### {t} {s} (exit 0)" for t in tools for s in ("decodes", "gqa_decodes_int4")
    ]
    for t in tools:
        assert f"{t}: 2 sections, 0 errors" in proc.stdout
    assert not list(tmp_path.glob("report.txt.*")), "a section's temporary report was left"


def test_each_section_runs_once_without_the_tool_before_the_tools(tmp_path):
    proc, report = run(tmp_path, warm=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    warm = (tmp_path / "warm.log").read_text().split()
    assert sorted(warm) == ["decodes", "gqa_decodes_int4"]
    assert "memcheck: 2 sections, 0 errors" in proc.stdout
    assert not list(tmp_path.glob("report.txt.*")), "a warm-up's output was left"


@pytest.mark.parametrize(
    ("bad", "short", "expect"),
    [
        (
            "initcheck:gqa_decodes_int4",
            "",
            "initcheck: 2 sections; not clean: gqa_decodes_int4 (exit 3)",
        ),
        ("", "racecheck:decodes", "racecheck: 2 sections; not clean: decodes (no clean summary)"),
    ],
)
def test_an_error_or_a_missing_summary_fails_the_script(tmp_path, bad, short, expect):
    proc, report = run(tmp_path, bad=bad, short=short)
    assert proc.returncode != 0
    assert expect in proc.stdout


# a stand-in for a sanitizer run that does not end by itself: it notes its pid, prints a line
# and waits
HANG_STUB = """#!/bin/bash
echo $$ >>"$PIDS"
echo "began $2 ${@: -1}"
exec sleep 300
"""


def test_a_stopped_script_stops_its_runs_and_the_tools_own_time_limits(tmp_path):
    """Stopped by an outer `timeout` (which passes its SIGTERM on to the script), the script
    stops every run still going, those under KVGEN_SANITIZER_TIMEOUT too: each is in a process
    group of its own (timeout's), and left alone would go on using the GPU after the script.
    It still writes its one report, each run marked stopped with what it printed, and leaves
    no per-run file (a device call brings back a few files only)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (
        ("compute-sanitizer", HANG_STUB),
        ("nvidia-smi", "#!/bin/bash\necho stub\n"),
    ):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    pids = tmp_path / "pids"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=sys.executable)
    env |= {"PIDS": str(pids), "KVGEN_COMMIT": "test", "KVGEN_SANITIZER_WARM": "0"}
    env |= {"KVGEN_SANITIZER_TIMEOUT": "200"}
    # The script runs under an outer `timeout`, which is sent SIGTERM once the eight runs have
    # started and passes it on to the script, as it does when its time is up (with a fixed time
    # limit instead, eight runs did not always start within it on a loaded machine).
    cmd = ["timeout", "300", "bash", str(ROOT / "scripts/gpu_check.sh"), str(tmp_path / "r.txt")]
    proc = subprocess.Popen([*cmd, "decodes", "mla_rows"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 120
    started = []
    while len(started) < 8 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
        started = [int(p) for p in pids.read_text().split()] if pids.exists() else []
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143  # the script's exit on TERM, after stopping its runs
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 8  # 4 tools x 2 sections, all started before the signal
    deadline = time.monotonic() + 10
    alive = started
    while alive and time.monotonic() < deadline:
        alive = [p for p in started if Path(f"/proc/{p}").exists()]
        time.sleep(0.1)
    for p in alive:  # (not to leave them behind when the test fails)
        os.kill(p, signal.SIGKILL)
    assert not alive, f"{len(alive)} of the 8 runs outlived the script"
    report = (tmp_path / "r.txt").read_text()
    tools = ["memcheck", "initcheck", "synccheck", "racecheck"]
    for t in tools:
        for section in ("decodes", "mla_rows"):
            assert f"### {t} {section} (exit stopped)\nbegan {t} {section}\n" in report
    assert not list(tmp_path.glob("r.txt.*")), "a run's temporary report was left"


def test_the_store_section_checks_vllm_inline_rows_and_every_thread_layout_on_them():
    """scripts/gpu_check.py's per-token-head section (what the sanitizer runs) under the
    interpreter: every store it lists writes the reference's bytes, on HND views and on vLLM's
    inline-scale rows, through the op and at the int8 / fp8 store's RUNS 2 and 4 and the int4
    store's 4-byte pieces (324-byte rows)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-P", str(ROOT / "scripts/gpu_check.py"), "per_token_head_stores"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "all ok" and not [x for x in lines if x.startswith("FAIL")]
    inline = [x for x in lines if " inline" in x]
    assert any("int8-d128" in x and "'tokens_per_program': 2" in x for x in inline)
    assert any("int4_per_token_head-c32-d576-dv576" in x for x in inline)
    assert len(inline) == 11  # int8, e4m3, e5m2 x (op, RUNS 2, RUNS 4); int4 at 128 and 576
