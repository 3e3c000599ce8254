"""The command line: list, gen, verify and --help, as a user runs them."""

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


def test_verify_runs_variants_against_the_reference():
    names = [
        f"store_mxfp4_mla-g64-l448-fp32-flat-{ARCH}-{TARGET}",
        f"gather_mxfp4_mla-g16-l256-bf16-paged-{ARCH}-{TARGET}",
    ]
    result = runner.invoke(app, ["verify", *names])
    assert result.exit_code == 0, result.output
    assert "2 passed, 0 failed" in result.output


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


def test_verify_accuracy_table(monkeypatch):
    from rich.console import Console

    import kvgen.cli

    monkeypatch.setattr(kvgen.cli, "console", Console(width=200))
    result = runner.invoke(app, ["verify", "--accuracy"])
    assert result.exit_code == 0, result.output
    for fmt in ("int8 per token-head", "fp8 e4m3", "int4 levels, 32 ch/scale", "mxfp4, group 32"):
        assert fmt in result.output
    assert "student-t(3)" in result.output and "outlier" in result.output


def test_verify_kv_variant():
    name = f"store_kv_int4_per_token_head-c16-d80-dv80-bf16-{ARCH}-{TARGET}"
    result = runner.invoke(app, ["verify", name])
    assert result.exit_code == 0, result.output
    assert "1 passed, 0 failed" in result.output


def test_every_family_has_a_verifier():
    from kvgen.verify import VERIFIERS

    assert set(registry.families()) <= set(VERIFIERS)


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
