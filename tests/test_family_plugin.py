"""A family defined outside kvgen (tests/toy_family: spec, one tiny template, search space,
reference, check, tuning problem) works through the family interface alone: registered by the
``kvgen.families`` entry point it is listed, generated and verified by the CLI in a fresh
process; registered at run time it is planned, tuned with a fake timer and its tuned config is
read back by the loader. No kvgen file names it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from kvgen import configs, registry
from kvgen.runtime import local_target

TOY = Path(__file__).with_name("toy_family")
ARCH, TARGET = local_target()


def _kvgen(*args, tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TOY), os.environ.get("PYTHONPATH", "")]),
        "KVGEN_CACHE_DIR": str(tmp_path / "cache"),
    }
    return subprocess.run(
        [sys.executable, "-m", "kvgen", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )


def test_entry_point_family_is_listed_generated_and_verified(tmp_path):
    listed = _kvgen("list", "--family", "toy_scale", tmp_path=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split() == [f"toy_scale-w{w}-{ARCH}-{TARGET}" for w in (16, 32)]
    gen = _kvgen("gen", "--out", "g", "toy_scale", tmp_path=tmp_path)
    assert gen.returncode == 0, gen.stderr
    text = (tmp_path / "g" / f"toy_scale-w32-{ARCH}-{TARGET}.py").read_text()
    assert "Variant: toy_scale-w32" in text and "WIDTH = 32" in text
    verified = _kvgen("verify", "toy_scale", tmp_path=tmp_path)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "2 passed, 0 failed" in verified.stdout


@pytest.fixture
def toy():
    registry.all_families()  # discovered before the toy's entry point is on the path
    sys.path.insert(0, str(TOY))
    try:
        import toy_family

        fam = registry.register(toy_family.FAMILY)
        yield fam
    finally:
        registry.unregister("toy_scale")
        sys.path.remove(str(TOY))
        sys.modules.pop("toy_family", None)


def test_registered_family_is_planned_tuned_and_loaded(toy, tmp_path, monkeypatch):
    optuna = pytest.importorskip("optuna")
    del optuna
    from kvgen.tune import plan, tuner

    assert "toy_scale" in registry.families()
    studies = plan.plan(None, "sm90", families={"toy_scale"})
    assert {(s.spec.width, s.bucket["num_tokens"]) for s in studies} == {
        (w, t) for w in (16, 32) for t in (4, 64)
    }

    def fake(meta):  # the best: 2 rows a program, 1 warp
        return 1.0 + abs(meta["rows_per_program"] - 2) + (meta["num_warps"] - 1) * 0.5

    storage = tuner.storage_from(None, tmp_path / "toy.journal")
    results = [
        tuner.run_study(s.spec, s.bucket, s.space, fake, storage=storage, sampler="grid")
        for s in studies
    ]
    assert all(r.meta == {"rows_per_program": 2, "num_warps": 1} for r in results)
    env = {
        "cuda": "13.0",
        "device": "fake",
        "kvgen": "0",
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    path = tuner.write_results(tmp_path, "sm90", "toy_scale", results, env, "grid", 6)
    assert path == tmp_path / "sm90" / "toy_scale.json"
    monkeypatch.setenv(configs.OVERRIDE_ENV, str(tmp_path))
    configs.reset()
    try:
        spec = toy.spec_class(32, "sm90", "interp")
        assert configs.meta_params(spec, num_tokens=50) == {"rows_per_program": 2, "num_warps": 1}
        # and the tuned meta-parameters run: the kernel under this machine's target
        local = toy.spec_class(32, ARCH, TARGET)
        assert toy.verify(local, "cuda" if TARGET == "gpu" else "cpu").passed
    finally:
        configs.reset()


def test_no_dispatch_on_family_names_outside_the_family_folders():
    # ``spec.family == "..."``, ``family in (...)`` or a table keyed by family names, anywhere in
    # kvgen but kvgen/families/, would be a family chosen by name.
    import re

    root = Path(registry.__file__).parent
    names = "|".join(re.escape(n) for n in registry.families())
    patterns = [
        re.compile(r"\bfamily\s*(==|!=)\s*[\"']"),
        re.compile(r"\bfamily\s+(not\s+)?in\s*[(\[{]\s*[\"']"),
        re.compile(rf"[\"']({names})[\"']\s*:"),
        re.compile(rf"(==|!=)\s*[\"']({names})[\"']"),
    ]
    offenders = []
    for path in root.rglob("*.py"):
        if "families" in path.relative_to(root).parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if any(p.search(line) for p in patterns):
                offenders.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
