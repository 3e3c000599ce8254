"""benchmarks/nibble_repro.py, the 16-key nibble unpacking reproducer: its reference puts
channel 2i in byte i's low nibble (as FORMATS.md packs int4 and E2M1 codes), its kernel matches
it under the interpreter at 16 and 32 keys in every form, and every form compiles for sm90
through Triton's GPU pipeline, so a GPU run finds it runnable."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from _scripts import BENCHMARKS, benchmark_script

REPRO = benchmark_script("nibble_repro")


def test_the_reference_reads_the_low_nibble_first():
    codes = torch.zeros(1, REPRO._D // 2, dtype=torch.uint8)
    codes[0, 0] = 0x9A  # channel 0: code 0xA (-2), channel 1: code 0x9 (-1)
    codes[0, 1] = 0x37  # channel 2: 7, channel 3: 3
    vals = REPRO.reference(codes, torch.full((1, REPRO._GROUPS), 2.0))
    assert vals[0, :4].tolist() == [-4.0, -2.0, 14.0, 6.0]
    assert vals[0, 4:].abs().sum() == 0


# (the asm form's inline PTX has no interpreter build; it compiles below)
@pytest.mark.parametrize("form", [f for f in REPRO.FORMS if f != "asm"])
@pytest.mark.parametrize("block_n", [16, 32])
def test_the_kernel_matches_the_reference_under_the_interpreter(block_n, form):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter's build; the GPU's is what the script is for")
    s_err, o_err = REPRO.run(block_n, 16, 4, form, "cpu")
    assert s_err < 1e-5 and o_err < 1e-5


def test_both_builds_compile_for_sm90():
    code = textwrap.dedent(f"""
        import sys
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        sys.path.insert(0, {str(BENCHMARKS)!r})
        import nibble_repro as nr
        sig = dict.fromkeys(("BLOCK_N", "BLOCK_H", "FORM"), "constexpr")
        sig = {{"codes_ptr": "*u8", "scale_ptr": "*fp32", "k_ptr": "*fp16", "q_ptr": "*fp16",
                "p_ptr": "*fp16", "s_ptr": "*fp32", "o_ptr": "*fp32", **sig}}
        for block_n in (16, 32):
            for form in range(len(nr.FORMS)):
                consts = {{"BLOCK_N": block_n, "BLOCK_H": 16, "FORM": form}}
                src = ASTSource(nr._kernel, sig, consts)
                target = GPUTarget("cuda", 90, 32)
                k = triton.compile(src, target=target, options={{"num_warps": 4}})
                assert k.asm["cubin"], (block_n, form)
                print("ok", block_n, form)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("ok ") == 2 * len(REPRO.FORMS)


def test_a_form_triton_fails_to_build_is_reported_and_the_run_goes_on(monkeypatch, capsys):
    def run(block_n, block_h, warps, form, device):
        if form == "join":
            raise RuntimeError("error: ...\nPassManager::run failed")
        return 0.0, 0.5 if block_n == 16 else 0.0

    monkeypatch.setattr(REPRO, "run", run)
    REPRO.main(["--forms", "join", "direct", "--device", "cpu"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 * 27
    assert sum("BUILD FAILED (PassManager::run failed)" in line for line in lines) == 27
    assert sum(line.endswith("WRONG") for line in lines) == 9  # direct at 16 keys
