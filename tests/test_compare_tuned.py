"""benchmarks/compare_tuned.py: two tuned_configs folders' configs timed against each other,
bucket by bucket (here with the tuner tests' fake timer)."""

import json
from pathlib import Path

import pytest

pytest.importorskip("optuna")

import _fake_tuning as fake  # noqa: E402
from _scripts import benchmark_script  # noqa: E402

from kvgen import configs  # noqa: E402
from kvgen.families.mxfp4_mla import StoreMXFP4MLASpec  # noqa: E402
from kvgen.space import load_space  # noqa: E402
from kvgen.tune import tuner  # noqa: E402

compare_tuned = benchmark_script("compare_tuned")

SPEC = StoreMXFP4MLASpec(32, 512, "bf16", "paged", "sm90", "gpu")
BEST = {"rows_per_program": 4, "num_warps": 2, "num_stages": 1}
SLOWER = {"rows_per_program": 8, "num_warps": 2, "num_stages": 1}


def _folder(path: Path, metas: dict[str, dict]) -> Path:
    results = [
        tuner.StudyResult(SPEC.name, key, meta, fake.cost(meta), None, 10, 0)
        for key, meta in metas.items()
    ]
    tuner.write_results(path, "sm90", SPEC.family, results, fake.environment(), "local", 40)
    return path


def test_two_folders_configs_timed_bucket_by_bucket(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVGEN_TUNE_EVALUATOR", "_fake_tuning:evaluator")
    a = _folder(tmp_path / "a", {"num_tokens=16": BEST, "num_tokens=4096": BEST,
                                 "num_tokens=65536": SLOWER})  # fmt: skip
    b = _folder(tmp_path / "b", {"num_tokens=16": BEST, "num_tokens=4096": SLOWER,
                                 "num_tokens=65536": BEST, "num_tokens=1": BEST})  # fmt: skip
    out = tmp_path / "cmp.json"
    assert compare_tuned.main([str(a), str(b), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {r["bucket"]: r for r in doc["rows"]}
    assert set(rows) == {"num_tokens=16", "num_tokens=4096", "num_tokens=65536"}  # in both
    assert rows["num_tokens=16"]["same"] and rows["num_tokens=16"]["ratio"] == 1.0
    worse = fake.cost(SLOWER) / fake.cost(BEST)
    assert rows["num_tokens=4096"]["ratio"] == pytest.approx(worse)
    assert rows["num_tokens=65536"]["ratio"] == pytest.approx(1 / worse)
    assert doc["summary"].startswith("2/3 buckets with B within 2% of A (1 the same config)")
    printed = capsys.readouterr().out
    assert "worst B/A" in printed
    # the bucket only B tuned is named, not silently left out
    assert doc["only_in_a"] == [] and doc["only_in_b"] == [f"{SPEC.name} @ num_tokens=1"]
    assert f"only in B: {SPEC.name} @ num_tokens=1" in printed
    assert doc["summary"].endswith("; 0 only in A, 1 only in B")


def test_device_files_replace_the_archs_with_device(tmp_path, monkeypatch):
    monkeypatch.setenv("KVGEN_TUNE_EVALUATOR", "_fake_tuning:evaluator")
    a = _folder(tmp_path / "a", {"num_tokens=16": BEST})
    b = _folder(tmp_path / "b", {"num_tokens=16": BEST})
    (b / "sm90" / "nvidia-h200").mkdir()
    (b / "sm90" / f"{SPEC.family}.json").rename(b / "sm90" / "nvidia-h200" / f"{SPEC.family}.json")
    _folder(b, {"num_tokens=16": SLOWER})  # the arch's file, which the device's replaces
    out = tmp_path / "cmp.json"
    assert compare_tuned.main([str(a), str(b), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rows"][0]["ratio"] == pytest.approx(
        fake.cost(SLOWER) / fake.cost(BEST)
    )
    assert compare_tuned.main([str(a), str(b), "--device", "nvidia-h200", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rows"][0]["same"]


def test_nothing_in_common_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KVGEN_TUNE_EVALUATOR", "_fake_tuning:evaluator")
    a = _folder(tmp_path / "a", {"num_tokens=16": BEST})
    assert compare_tuned.main([str(a), str(tmp_path / "empty")]) == 1
    with pytest.raises(SystemExit):
        compare_tuned.main([str(a), str(a), "--rounds", "0"])


def test_drop_studies_deletes_the_studies_named_and_a_resumed_run_does_them_again(tmp_path):
    """benchmarks/drop_studies.py: the studies whose names hold a pattern go (trials and all),
    the others stay, and a run on the same storage runs the dropped ones afresh."""
    drop_studies = benchmark_script("drop_studies")
    journal = str(tmp_path / "tune.journal")
    store = tuner.storage_from(journal, Path(journal))
    space = load_space(SPEC.template)
    for n in (16, 4096):
        tuner.run_study(SPEC, {"num_tokens": n}, space, fake.cost, storage=store,
                        sampler="local", n_trials=4)  # fmt: skip
    assert drop_studies.drop(journal, ["@num_tokens=16"], dry_run=True) == [
        (f"{SPEC.name}@num_tokens=16", 4)
    ]
    assert tuner.load_study(SPEC, {"num_tokens": 16}, store) is not None  # (a dry run)
    gone = drop_studies.drop(journal, ["@num_tokens=16"])
    assert gone == [(f"{SPEC.name}@num_tokens=16", 4)]
    store = tuner.storage_from(journal, Path(journal))
    assert tuner.load_study(SPEC, {"num_tokens": 16}, store) is None
    assert len(tuner.load_study(SPEC, {"num_tokens": 4096}, store).trials) == 4
    calls = []
    tuner.run_study(SPEC, {"num_tokens": 16}, space, lambda m: calls.append(m) or fake.cost(m),
                    storage=store, sampler="local", n_trials=4)  # fmt: skip
    assert len(calls) == 4


def test_adopt_faster_takes_a_s_config_where_the_compare_timed_it_faster(tmp_path, monkeypatch):
    """benchmarks/adopt_faster.py: B's folder gets A's config where the compare timed A faster
    by more than the margin, its time on B's scale and where it came from recorded; ties, the
    same config and an entry changed since the compare stay as they are."""
    adopt_faster = benchmark_script("adopt_faster")
    monkeypatch.setenv("KVGEN_TUNE_EVALUATOR", "_fake_tuning:evaluator")
    a = _folder(tmp_path / "a", {"num_tokens=16": BEST, "num_tokens=4096": BEST,
                                 "num_tokens=65536": SLOWER, "num_tokens=256": BEST})  # fmt: skip
    b = _folder(tmp_path / "b", {"num_tokens=16": BEST, "num_tokens=4096": SLOWER,
                                 "num_tokens=65536": BEST, "num_tokens=256": SLOWER})  # fmt: skip
    cmp = tmp_path / "cmp.json"
    assert compare_tuned.main([str(a), str(b), "--json", str(cmp)]) == 0
    path = b / "sm90" / f"{SPEC.family}.json"
    doc = json.loads(path.read_text())
    before = doc["entries"][SPEC.name]
    # num_tokens=256 changed in B since the compare: not B's config of the compare any more
    before["num_tokens=256"]["meta"] = dict(BEST, num_stages=2)
    path.write_text(json.dumps(doc))
    assert adopt_faster.main([str(cmp), str(b)]) == 0
    after = json.loads(path.read_text())["entries"][SPEC.name]
    won = after["num_tokens=4096"]
    assert won["meta"] == BEST
    assert won["time_us"] == pytest.approx(
        before["num_tokens=4096"]["time_us"] * fake.cost(BEST) / fake.cost(SLOWER), abs=1e-4
    )
    assert won["adopted"]["replaced"] == SLOWER and won["adopted"]["from"] == str(cmp)
    assert won["adopted"]["a_us"] < won["adopted"]["b_us"]
    for key in ("num_tokens=16", "num_tokens=65536", "num_tokens=256"):  # same, B faster, left
        assert after[key] == before[key]
    assert configs.validate(json.loads(path.read_text())) == []
    # a margin wider than the gap adopts nothing
    path.write_text(json.dumps(doc))
    worse = fake.cost(SLOWER) / fake.cost(BEST)
    assert adopt_faster.main([str(cmp), str(b), "--margin", str(worse)]) == 0
    assert json.loads(path.read_text())["entries"][SPEC.name] == before


def test_adopt_faster_writes_a_gpu_models_own_files(tmp_path, monkeypatch):
    adopt_faster = benchmark_script("adopt_faster")
    monkeypatch.setenv("KVGEN_TUNE_EVALUATOR", "_fake_tuning:evaluator")
    a = _folder(tmp_path / "a", {"num_tokens=4096": BEST})
    b = _folder(tmp_path / "b", {"num_tokens=4096": SLOWER})
    device = configs.device_folder(fake.environment()["device"])
    (b / "sm90" / device).mkdir()
    (b / "sm90" / f"{SPEC.family}.json").rename(b / "sm90" / device / f"{SPEC.family}.json")
    cmp = tmp_path / "cmp.json"
    assert compare_tuned.main([str(a), str(b), "--device", device, "--json", str(cmp)]) == 0
    assert adopt_faster.main([str(cmp), str(b), "--device", device]) == 0
    doc = json.loads((b / "sm90" / device / f"{SPEC.family}.json").read_text())
    assert doc["entries"][SPEC.name]["num_tokens=4096"]["meta"] == BEST
    assert not (b / "sm90" / f"{SPEC.family}.json").exists()
