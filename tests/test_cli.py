"""The command line: list, gen, verify and --help, as a user runs them."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvgen import registry
from kvgen.cli import app
from kvgen.runtime import local_target

runner = CliRunner()
ARCH, TARGET = local_target()


def test_list_names_every_variant():
    result = runner.invoke(app, ["list"])
    assert result.exit_code == 0, result.output
    names = result.stdout.split()
    assert names == [s.name for s in registry.variants(ARCH, TARGET)]
    assert any("-l448-" in n for n in names)


def test_list_family_and_arch():
    result = runner.invoke(
        app, ["list", "--family", "gather_mxfp4_mla", "--arch", "sm80", "--target", "gpu"]
    )
    assert result.exit_code == 0
    assert result.stdout.split() and all(
        n.startswith("gather_mxfp4_mla-") and n.endswith("-sm80-gpu") for n in result.stdout.split()
    )
    assert runner.invoke(app, ["list", "--arch", "sm75"]).exit_code != 0
    assert runner.invoke(app, ["list", "--family", "nope"]).exit_code == 2


def test_list_shows_what_names_and_patterns_give():
    sm90 = ["list", "--arch", "sm90", "--target", "gpu"]
    result = runner.invoke(app, [*sm90, "gqa_decode-*-rows-*"])
    assert result.exit_code == 0, result.output
    want = [s.name for s in registry.variants("sm90", "gpu", "gqa_decode") if s.variant == "rows"]
    assert result.stdout.split() == want and want
    both = [*sm90, "--family", "gqa_decode", "gqa_decode-*"]
    assert runner.invoke(app, both).stdout.split() == [
        s.name for s in registry.variants("sm90", "gpu", "gqa_decode")
    ]
    other = runner.invoke(app, ["list", "--family", "mla_decode", "gqa_decode-*"])
    assert other.exit_code == 0 and other.stdout.split() == []
    assert runner.invoke(app, ["list", "gqa_decode-*-rowz"]).exit_code == 2


def test_gen_writes_readable_sources(tmp_path):
    name = f"store_mxfp4_mla-g32-l448-bf16-paged-{ARCH}-{TARGET}"
    result = runner.invoke(app, ["gen", "--out", str(tmp_path), name])
    assert result.exit_code == 0, result.output
    text = (tmp_path / f"{name}.py").read_text()
    assert "@triton.jit" in text and f"Variant: {name}" in text
    again = runner.invoke(app, ["gen", "--out", str(tmp_path), name])
    assert "0 written, 1 unchanged" in again.output


def test_gen_unknown_name_suggests():
    result = runner.invoke(app, ["gen", "store_mxfp4_mla-g32-l512-bf16-paged"])
    assert result.exit_code == 2
    assert "no variant or family" in result.output


def test_gen_takes_a_pattern_of_variant_names(tmp_path):
    want = [s.name for s in registry.variants(ARCH, TARGET) if s.family == "gather_mxfp4_rope_mla"]
    result = runner.invoke(app, ["gen", "--out", str(tmp_path), "gather_mxfp4_rope_mla-*"])
    assert result.exit_code == 0, result.output
    assert sorted(p.stem for p in tmp_path.iterdir()) == sorted(want) and want
    nothing = runner.invoke(app, ["gen", "--out", str(tmp_path / "x"), "gather_*-rowz"])
    assert nothing.exit_code == 2 and "matches 'gather_*-rowz'" in nothing.output
    assert not (tmp_path / "x").exists()


def test_verify_runs_variants_against_the_reference():
    names = [
        f"store_mxfp4_mla-g64-l448-fp32-flat-{ARCH}-{TARGET}",
        f"gather_mxfp4_mla-g16-l256-bf16-paged-{ARCH}-{TARGET}",
    ]
    result = runner.invoke(app, ["verify", *names])
    assert result.exit_code == 0, result.output
    assert "2 passed, 0 failed" in result.output


def test_verify_in_worker_processes_reports_what_one_process_does():
    names = [
        f"store_mxfp4_mla-g32-l256-bf16-paged-{ARCH}-{TARGET}",
        f"gather_mxfp4_mla-g16-l256-bf16-paged-{ARCH}-{TARGET}",
        f"store_kv_per_token_head-int8-d64-dv64-fp16-{ARCH}-{TARGET}",
    ]
    docs = []
    for jobs in ("2", "1"):
        result = runner.invoke(app, ["verify", "--json", "-j", jobs, *names])
        assert result.exit_code == 0, result.output
        docs.append(json.loads(result.stdout))
    assert docs[0] == docs[1] and [r["name"] for r in docs[0]["results"]] == names
    bad = runner.invoke(app, ["verify", "-j", "-1", names[0]])
    assert bad.exit_code != 0 and "--jobs" in bad.output


@pytest.mark.parametrize("command", [[], ["list"], ["gen"], ["verify"], ["bench"]])
def test_help(command):
    result = runner.invoke(app, [*command, "--help"])
    assert result.exit_code == 0
    assert "Usage" in result.output


def test_python_dash_m():
    out = subprocess.run(
        [sys.executable, "-m", "kvgen", "list", "--family", "store_mxfp4_mla"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert len(out.stdout.split()) == len(registry.variants(ARCH, TARGET, "store_mxfp4_mla"))


def test_verify_accuracy_table():
    result = runner.invoke(app, ["verify", "--accuracy"])
    assert result.exit_code == 0, result.output
    for fmt in ("int8 per token-head", "fp8 e4m3", "int4 levels, 32 ch/scale", "mxfp4, group 32"):
        assert fmt in result.output
    assert "student-t(3)" in result.output and "outlier" in result.output
    for fmt in ("fp8_ds_mla", "fp8 (per tensor)", "mxfp4, group 32, bf16 RoPE"):
        assert fmt in result.output
    assert "GQA decode over each per-token-head cache format" in result.output


def test_mla_accuracy_table():
    from kvgen.verify import mla_accuracy_table

    rows = {r["format"]: r for r in mla_accuracy_table(batch=2, seqlen=64)}
    assert rows["bf16"]["out_rel_err"] == 0 and rows["bf16"]["lse_max_err"] == 0
    assert [r["bytes_per_token"] for r in rows.values()] == [1152, 656, 576, 400]
    # 4-bit elements lose more than 8-bit ones with a scale per 128 channels
    ds, mx = rows["fp8_ds_mla"], rows["mxfp4, group 32, bf16 RoPE"]
    assert 0 < ds["out_rel_err"] < mx["out_rel_err"] < 1
    assert mla_accuracy_table(batch=2, seqlen=64) == list(rows.values())  # seeded: repeatable


def test_gqa_accuracy_table():
    from kvgen.verify import gqa_accuracy_table

    rows = {r["format"]: r for r in gqa_accuracy_table(batch=2, seqlen=64)}
    assert rows["bf16"]["out_rel_err"] == 0 and rows["bf16"]["lse_max_err"] == 0
    assert [r["bytes_per_token"] for r in rows.values()] == [4096] + [2112] * 3 + [
        1280, 1152, 1088, 1056
    ]  # fmt: skip
    err = {name: r["out_rel_err"] for name, r in rows.items()}
    # 7 bits beat e4m3's 3 mantissa bits, which beat e5m2's 2; finer int4 scale groups lose
    # less, and every 4-bit format more than every 8-bit one
    assert 0 < err["int8"] < err["fp8 e4m3"] < err["fp8 e5m2"] < err["int4, 16 ch/scale"]
    assert err["int4, 16 ch/scale"] < err["int4, 32 ch/scale"] < err["int4, 128 ch/scale"] < 1
    assert gqa_accuracy_table(batch=2, seqlen=64) == list(rows.values())  # seeded: repeatable


def test_verify_kv_variant():
    name = f"store_kv_int4_per_token_head-c16-d80-dv80-bf16-{ARCH}-{TARGET}"
    result = runner.invoke(app, ["verify", name])
    assert result.exit_code == 0, result.output
    assert "1 passed, 0 failed" in result.output


def test_every_family_is_a_family_with_variants():
    from kvgen.families import Family

    for name, fam in registry.all_families().items():
        assert isinstance(fam, Family) and fam.name == name
        assert registry.variants(ARCH, TARGET, name), name


def test_verify_decode_variant():
    name = f"mla_decode-d288-dv256-fp16-portable-{ARCH}-{TARGET}"
    result = runner.invoke(app, ["verify", name])
    assert result.exit_code == 0, result.output
    assert "1 passed, 0 failed" in result.output


def test_verify_every_decode_variant():
    # Each variant on a cache its launcher accepts (the tma variant needs whole tiles a page).
    result = runner.invoke(app, ["verify", "mla_decode"])
    assert result.exit_code == 0, result.output
    n = len(registry.variants(ARCH, TARGET, "mla_decode"))
    assert f"{n} passed, 0 failed" in result.output


# --- what a new user meets: full output off a terminal, JSON, errors as written ---


def test_tables_are_not_cut_when_stdout_is_not_a_terminal():
    # CliRunner's stdout is not a terminal, as a file or a pipe is not.
    result = runner.invoke(app, ["show", "sm90"])
    assert result.exit_code == 0, result.output
    assert "…" not in result.stdout
    assert "mla_decode-d576-dv512-bf16-wgmma-sm90-gpu" in result.stdout
    assert "split_factor=1" in result.stdout
    name = f"mla_decode-d576-dv512-bf16-portable-{ARCH}-{TARGET}"
    result = runner.invoke(app, ["verify", name])
    assert result.exit_code == 0, result.output
    assert name in result.stdout and "…" not in result.stdout


def test_wide_tables_on_a_terminal(monkeypatch):
    monkeypatch.setattr("sys.stdout.isatty", lambda: True, raising=False)
    result = runner.invoke(app, ["show", "sm90", "--wide"])
    assert result.exit_code == 0, result.output
    assert "store_kv_int4_per_token_head-c32-d576-dv576-bf16-sm90-gpu" in result.stdout


def test_json_output_parses():
    import json

    listed = json.loads(runner.invoke(app, ["list", "--json", "--family", "mla_decode"]).stdout)
    assert [d["name"] for d in listed] == [
        s.name for s in registry.variants(ARCH, TARGET, "mla_decode")
    ]
    assert all(d["family"] == "mla_decode" and "head_dim" in d["fields"] for d in listed)
    shown = json.loads(runner.invoke(app, ["show", "sm90", "--json"]).stdout)
    assert shown["arch"] == "sm90" and shown["files"]
    rows = [r for f in shown["files"] for r in f["rows"]]
    assert all({"variant", "bucket", "meta", "time_us", "used"} <= set(r) for r in rows)
    name = f"gather_mxfp4_mla-g16-l256-bf16-paged-{ARCH}-{TARGET}"
    result = runner.invoke(app, ["verify", "--json", name])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["passed"] == 1 and doc["failed"] == 0 and doc["results"][0]["name"] == name
    acc = json.loads(runner.invoke(app, ["verify", "--accuracy", "--json"]).stdout)
    assert {"format", "data", "snr_db", "max_err_amax"} <= set(acc["formats"][0])
    assert {"format", "bytes_per_token", "out_rel_err", "lse_max_err"} <= set(acc["decode"][0])
    assert {"format", "bytes_per_token", "out_rel_err"} <= set(acc["gqa"][0])


def test_show_marks_the_decode_variant_each_bucket_uses():
    import json

    shown = json.loads(runner.invoke(app, ["show", "sm90", "--json"]).stdout)
    files = [f for f in shown["files"] if f["family"] == "mla_decode"]
    assert [f["device"] for f in files] == [None, "nvidia-h100-80gb-hbm3"]  # each file alone
    for decode in (f["rows"] for f in files):
        for bucket in {r["bucket"] for r in decode}:
            bf16 = [r for r in decode if "-d576-dv512-bf16-" in r["variant"]]
            at = [r for r in bf16 if r["bucket"] == bucket]
            used = [r for r in at if r["used"]]
            assert len(used) == 1, (bucket, at)
            assert used[0]["time_us"] == min(r["time_us"] for r in at)
    # families without a choice between variants: every entry is what its op uses
    stores = [r for f in shown["files"] if f["family"] == "store_mxfp4_mla" for r in f["rows"]]
    assert stores and all(r["used"] for r in stores)
    table = runner.invoke(app, ["show", "sm90"]).stdout
    line = next(x for x in table.splitlines() if "wgmma-sm90-gpu" in x and "rows=16 " in x)
    assert "yes" in line


def test_show_names_the_entries_taken_from_another_run():
    """The package's H100 files hold configs a 40-trial TPE run timed faster
    (benchmarks/adopt_faster.py): show's JSON carries each one's record, its table says so
    under the file's table; entries of the run itself have none."""
    import json

    shown = json.loads(runner.invoke(app, ["show", "sm90", "--json"]).stdout)
    h100 = [f for f in shown["files"] if f["device"] == "nvidia-h100-80gb-hbm3"]
    rows = {(r["variant"], r["bucket"]): r for f in h100 for r in f["rows"]}
    taken = [k for k, r in rows.items() if r["adopted"]]
    assert ("gqa_decode-d128-dv128-bf16-kvint8-g0-portable-sm90-gpu", "rows=32") in taken
    record = rows[taken[0]]["adopted"]
    assert record["a_us"] < record["b_us"] and record["replaced"] != rows[taken[0]]["meta"]
    arch_rows = [r for f in shown["files"] if f["device"] is None for r in f["rows"]]
    assert all(r["adopted"] is None for r in arch_rows)
    text = runner.invoke(app, ["show", "sm90"], env={"COLUMNS": "400"}).stdout
    words = " ".join(text.split())  # (the list of entries wraps at the table's width)
    assert "entries hold another run's config" in words
    assert "gqa_decode-d128-dv128-bf16-kvint8-g0-portable-sm90-gpu @ rows=32" in words


def test_bracketed_text_is_printed_as_written(monkeypatch):
    result = runner.invoke(app, ["list", "--family", "store[x]"])
    assert result.exit_code == 2
    assert "unknown family 'store[x]'" in result.output
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna fails
    result = runner.invoke(app, ["tune"])
    assert result.exit_code == 2
    assert "pip install 'kvgen[tune]'" in result.output

    from kvgen import verify

    msg = "k_scale_cache must be [num_blocks, block_size, num_kv_heads]"
    monkeypatch.setattr(
        verify, "verify", lambda spec, device: verify.Result(spec.name, False, 1, 1.0, msg)
    )
    result = runner.invoke(app, ["verify", f"mla_decode-d288-dv256-fp16-portable-{ARCH}-{TARGET}"])
    assert result.exit_code == 1
    assert msg in result.stdout


def test_a_full_name_says_its_target(tmp_path):
    # The README's example: a GPU variant generated on any machine, whatever this one runs.
    name = "store_kv_int4_per_token_head-c32-d576-dv576-bf16-sm90-gpu"
    result = runner.invoke(app, ["gen", "--out", str(tmp_path), name])
    assert result.exit_code == 0, result.output
    assert f"Variant: {name}" in (tmp_path / f"{name}.py").read_text()
    other = "mla_decode-d576-dv512-bf16-portable-sm80-interp"
    assert runner.invoke(app, ["gen", "--out", str(tmp_path), other]).exit_code == 0
    assert (tmp_path / f"{other}.py").exists()
    if TARGET == "interp":  # verify runs this machine's variants only, and says so
        result = runner.invoke(app, ["verify", name])
        assert result.exit_code == 2 and "cannot verify" in result.output


def test_version():
    import kvgen

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"kvgen {kvgen.__version__}"


def test_unknown_arch_is_the_same_error_everywhere():
    for args in (["show", "sm75"], ["list", "--arch", "sm75"], ["gen", "--arch", "sm75"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, args
        assert "unknown arch 'sm75'" in result.output, args


def test_tune_refuses_an_unknown_sampler_before_anything_runs():
    result = runner.invoke(app, ["tune", "--sampler", "bayes"])
    assert result.exit_code == 2
    assert "unknown sampler 'bayes'" in result.output
    assert "local, tpe, grid, random" in result.output


@pytest.mark.parametrize("command", ["tune", "verify", "bench", "show"])
def test_help_paragraphs_are_wrapped_whole(command):
    # Lines of one paragraph fill the width: a docstring's own line breaks are not kept.
    result = runner.invoke(app, [command, "--help"], terminal_width=100)
    assert result.exit_code == 0
    body = result.stdout.split("Options:")[0].split("Arguments:")[0].splitlines()
    for line, nxt in zip(body, body[1:], strict=False):
        if line.strip() and nxt.strip() and not line.lstrip().startswith("Usage"):
            assert len(line) >= 60, f"short line inside a paragraph: {line!r}"
    if command == "tune":
        assert "[default: (half the CPUs)]" in " ".join(result.stdout.split())


def test_show_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "tuned.png"
    result = runner.invoke(app, ["show", "sm90", "--plot", str(path)])
    assert result.exit_code == 0, result.output
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_bench_plot_from_a_bench_document(tmp_path):
    pytest.importorskip("matplotlib")
    from kvgen.bench import plots

    stores = [
        {"variant": f"store_kv_int8-h{h}", "num_tokens": t, "gbps": 10.0 * t**0.5 * h}
        for h in (1, 8)
        for t in (1, 16, 4096)
    ]
    decode = [
        {"variant": v, "lengths": "equal 4096", "heads": h, "tflops": h * 3.0}
        for v in ("auto", "mla_decode-d576-dv512-bf16-wgmma-sm90-gpu")
        for h in (16, 32, 64, 128)
    ]
    doc = {
        "env": {"device": "test", "commit": "abc"},
        "copy_bandwidth_GBps": 4000.0,
        "matmul_TFLOPs": 700.0,
        "results": stores,
        "decode": decode,
    }
    path = plots.bench_plot(doc, tmp_path / "bench.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    only_stores = plots.bench_plot({**doc, "decode": []}, tmp_path / "stores.png")
    assert only_stores.exists()

    def panels(png) -> int:  # the figure is 7.5 inches a panel at 120 dpi
        return round(int.from_bytes(png.read_bytes()[16:20], "big") / 900)

    assert panels(path) == 2
    # stores with their floors' times: a panel of floor time / store time between them
    floored = [{**r, "graph_us": 2.0, "floor_graph_us": 1.5} for r in stores]
    floored += [{**stores[0], "variant": "gather_mxfp4_mla", "floor_graph_us": None}]
    with_floors = plots.bench_plot({**doc, "results": floored}, tmp_path / "floors.png")
    assert panels(with_floors) == 3
    with pytest.raises(ValueError, match="no results"):
        plots.bench_plot({**doc, "decode": [], "results": []}, tmp_path / "none.png")


def test_plots_without_matplotlib_say_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = runner.invoke(app, ["show", "sm90", "--plot", str(tmp_path / "x.png")])
    assert result.exit_code == 2
    assert "pip install 'kvgen[plot]'" in result.output


def test_bench_command_prints_writes_and_plots(tmp_path, monkeypatch):
    """`kvgen bench` end to end with the GPU parts faked: the tables, the JSON, the plot, and
    exit 1 when a result is wrong."""
    import json

    import torch

    from kvgen.bench import decode, harness, store

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(harness, "environment", lambda commit=None: {"device": "fake GPU"})
    monkeypatch.setattr(harness, "copy_bandwidths", lambda device: {"memcpy": 4.0e12})
    orders = []  # the slot order each store's cases were asked for
    for name in ("mxfp4_cases", "mxfp4_gather_cases", "kv_cases"):
        monkeypatch.setattr(
            store, name, lambda *a, **k: orders.append(k.get("slot_order")) or iter(())
        )
    good = [True]

    def fake_store_run(cases, device, copy_bw, progress, compare_default):
        list(cases)
        rows = []
        for t in (1, 16):
            r = store.Row(
                "store_mxfp4_mla",
                "store_mxfp4_mla-g32-l512-bf16-paged-sm90-gpu",
                t,
                t * 1304,
                1.2 * t,
                40.0,
                1.0 * t,
            )
            r.gbps, r.bw_ratio, r.latency_ratio, r.correct = 1.0 * t, 0.1, 1.2, good[0]
            rows.append(r)
        return rows

    monkeypatch.setattr(store, "run", fake_store_run)
    monkeypatch.setattr(decode, "matmul_rate", lambda device: 7.0e14)
    row = decode.DecodeRow(
        "auto", "equal 4096", 16, 1, 524288, 150.0, 4000.0, 120.0, 0.9, 0.17, True
    )
    monkeypatch.setattr(decode, "run", lambda device, copy_bw, mm, progress=None: [row])
    from kvgen.bench import gqa_decode as gqa_bench

    g_row = gqa_bench.GQADecodeRow(
        "int8", "128 x 4096", 32, 524288, 2112, 349.4, 3169.0, 0.745, True, 0.66, "rows"
    )
    monkeypatch.setattr(gqa_bench, "run", lambda device, copy_bw, progress=None: [g_row])
    out = tmp_path / "b.json"
    args = ["bench", "--tokens", "1,16", "--ops", "mxfp4,decode,gqa_decode", "--json", str(out)]
    if __import__("importlib").util.find_spec("matplotlib"):
        args += ["--plot", str(tmp_path / "b.png")]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "store_mxfp4_mla-g32-l512-bf16-paged-sm90-gpu" in result.stdout
    assert "MLA decode, batch 128" in result.stdout and "equal 4096" in result.stdout
    gqa_lines = [line for line in result.stdout.splitlines() if "128 x 4096" in line]
    assert gqa_lines and " rows " in gqa_lines[0]  # the variant the op took
    doc = json.loads(out.read_text())
    assert doc["gqa"][0]["variant"] == "rows"
    assert doc["matmul_TFLOPs"] == 700.0 and len(doc["results"]) == 2 and doc["decode"]
    assert doc["slot_order"] == "random" and orders == ["random"]
    if "--plot" in args:
        assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    good[0] = False
    assert runner.invoke(app, args).exit_code == 1  # a wrong result fails the command
    result = runner.invoke(app, ["bench", "--ops", "mxfp4,nope"])
    assert result.exit_code == 2 and "unknown ops nope" in result.output
    good[0] = True
    orders.clear()
    result = runner.invoke(app, [*args, "--slot-order", "paged"])
    assert result.exit_code == 0, result.output
    assert orders == ["paged"] and json.loads(out.read_text())["slot_order"] == "paged"
    result = runner.invoke(app, ["bench", "--ops", "mxfp4", "--slot-order", "backwards"])
    assert result.exit_code == 2 and "--slot-order must be one of random" in result.output
