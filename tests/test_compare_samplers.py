"""benchmarks/compare_samplers.py without a GPU: its --fake grids, searched by the tuner's
own samplers, and the same grids again from its JSON (--grids-from)."""

import json

from _scripts import benchmark_script

samplers = benchmark_script("compare_samplers")


def test_fake_grids_are_searched_and_searched_again_from_the_json(tmp_path, capsys):
    out = tmp_path / "fake.json"
    args = ["--seeds", "2", "--trials", "10", "--samplers", "local", "--patience", "0,5"]
    samplers.main(["--fake", *args, "--json", str(out)])
    doc = json.loads(out.read_text())
    rows = doc["comparison"]
    assert {r["variant"] for r in rows} == {spec.name for spec, _ in samplers.CASES}
    for r in rows:  # every seed listed, each a ratio to the grid's best, never better
        assert len(r["ratios"]) == 2 and all(x >= 1.0 for x in r["ratios"])
        assert all(k <= 10 for k in r["trials_run"])
    again = tmp_path / "again.json"
    samplers.main(["--grids-from", str(out), *args, "--json", str(again)])
    redo = json.loads(again.read_text())["comparison"]
    assert [r["ratios"] for r in redo] == [r["ratios"] for r in rows]  # same grids, same search
    assert "searched" in json.loads(again.read_text())["env"]
