"""The GQA decode's code conversions are PTX (inline asm), which Triton's CPU interpreter cannot
run. Here the PTX text of each generated GPU kernel's ``k_codes_f16`` (four codes to fp16) and
``v_words`` (a 32-bit word of four codes to the queries' dtype) is executed by a small model of
the instructions it uses, on every code in every byte position, and compared bit for bit with
the format's values (NaN codes: NaN)."""

from __future__ import annotations

import ast

import numpy as np
import pytest
import torch

from kvgen.codegen.render import render
from kvgen.families.gqa_decode import GQADecodeSpec

U32 = np.uint32
CODES = {"int8": torch.int8, "fp8e4m3": torch.float8_e4m3fn, "fp8e5m2": torch.float8_e5m2}


def _asm(spec, function: str) -> str:
    """The PTX string of ``function``'s inline_asm_elementwise call in the generated source."""
    tree = ast.parse(render(spec))
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    call = next(n for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "attr", "")
                == "inline_asm_elementwise")  # fmt: skip
    return call.args[0].value


def _half(bits, dtype) -> np.ndarray:
    """float64 values of 16-bit patterns (held in uint32) of ``dtype`` (fp16 or bf16)."""
    b = (bits & U32(0xFFFF)).astype(np.uint16)
    if dtype == "f16":
        return b.view(np.float16).astype(np.float64)
    return (b.astype(U32) << U32(16)).view(np.float32).astype(np.float64)


def _bits16(x, dtype) -> np.ndarray:
    """16-bit patterns of float64 ``x`` rounded to nearest even in ``dtype``."""
    t = torch.from_numpy(np.asarray(x, dtype=np.float64)).to(
        torch.float16 if dtype == "f16" else torch.bfloat16
    )
    return t.view(torch.int16).numpy().astype(np.uint16).astype(U32)


def _prmt(a, b, sel):
    src = [(a >> U32(8 * i)) & U32(0xFF) for i in range(4)] + [
        (b >> U32(8 * i)) & U32(0xFF) for i in range(4)
    ]
    out = np.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        assert not nib & 8, "sign-replicate selectors are not modelled"
        out |= src[nib] << U32(8 * i)
    return out


def _e4m3_to_f16(byte) -> np.ndarray:
    v = torch.from_numpy(byte.astype(np.uint8)).view(torch.float8_e4m3fn).double().numpy()
    return _bits16(v, "f16")


def run_ptx(asm: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute ``asm`` (one ``{ ... }`` block of ';'-separated instructions) on uint32 arrays
    (16-bit registers hold their bits in the low half); returns every register."""
    regs = dict(inputs)
    shape = next(iter(inputs.values())).shape

    def val(o):
        return np.broadcast_to(U32(int(o, 0)), shape) if o[0].isdigit() else regs[o]

    for stmt in asm.strip().strip("{}").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        instr, _, rest = stmt.partition(" ")
        if rest.startswith("{"):  # mov.b32 {lo, hi}, word: split a word into halves
            pair, _, src = rest.partition("},")
            lo, hi = (r.strip() for r in pair.strip("{ ").split(","))
            w = val(src.strip())
            regs[lo], regs[hi] = w & U32(0xFFFF), w >> U32(16)
            continue
        ops = [o.strip() for o in rest.split(",")]
        args = [val(o) for o in ops[1:]]
        if instr == "mov.b32":
            r = args[0]
        elif instr == "xor.b32":
            r = args[0] ^ args[1]
        elif instr == "and.b32":
            r = args[0] & args[1]
        elif instr == "prmt.b32":
            r = _prmt(args[0], args[1], int(ops[3], 0))
        elif instr in ("sub.f16x2", "fma.rn.bf16x2"):
            dt = "f16" if "f16" in instr and "bf16" not in instr else "bf16"
            halves = []
            for s in (0, 16):
                a, b = (_half(x >> U32(s), dt) for x in args[:2])
                c = _half(args[2] >> U32(s), dt) if len(args) > 2 else None
                halves.append(_bits16(a - b if c is None else a * b + c, dt))
            r = halves[0] | (halves[1] << U32(16))
        elif instr == "cvt.rn.f16x2.e4m3x2":
            r = _e4m3_to_f16(args[0] & U32(0xFF)) | (_e4m3_to_f16(args[0] >> U32(8)) << U32(16))
        elif instr == "cvt.f32.f16":
            with np.errstate(invalid="ignore"):  # (NaN and inf halves are modelled)
                r = _half(args[0], "f16").astype(np.float32).view(U32)
        elif instr == "cvt.rn.bf16x2.f32":  # d = {bf16(a) high, bf16(b) low}
            f = [x.view(np.float32).astype(np.float64) for x in args[:2]]
            r = _bits16(f[1], "bf16") | (_bits16(f[0], "bf16") << U32(16))
        else:
            raise AssertionError(f"instruction not modelled: {stmt}")
        regs[ops[0]] = np.asarray(r, dtype=U32)
    return regs


def _words():
    """[n, 4] bytes holding every byte value in every position, and random ones; their words."""
    every = np.arange(256)
    rows = [np.roll(np.stack([every] * 4, 1), k, axis=0) for k in range(4)]
    rows.append(np.random.default_rng(0).integers(0, 256, size=(2048, 4)))
    b = np.concatenate(rows).astype(U32)
    return b, b[:, 0] | (b[:, 1] << U32(8)) | (b[:, 2] << U32(16)) | (b[:, 3] << U32(24))


def _check(got_bits: np.ndarray, codes: np.ndarray, kv: str, dtype: str):
    want = torch.from_numpy(codes.astype(np.uint8)).view(CODES[kv]).double().numpy()
    nan = np.isnan(want)
    assert np.array_equal(got_bits[~nan], _bits16(want[~nan], dtype))
    assert np.isnan(_half(got_bits[nan], dtype)).all()


@pytest.mark.parametrize("kv", ["int8", "fp8e4m3", "fp8e5m2"])
def test_k_codes_are_their_fp16_values(kv):
    codes, words = _words()
    asm = _asm(GQADecodeSpec(128, 128, "bf16", kv, 0, "portable", "sm90", "gpu"), "k_codes_f16")
    regs = run_ptx(asm, {"$2": words})
    got = np.stack([regs["$0"] & U32(0xFFFF), regs["$0"] >> U32(16), regs["$1"] & U32(0xFFFF),
                    regs["$1"] >> U32(16)], 1)  # fmt: skip
    _check(got, codes, kv, "f16")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("kv", ["int8", "fp8e4m3", "fp8e5m2"])
def test_v_words_are_their_values_in_the_queries_dtype(kv, dtype):
    codes, words = _words()
    asm = _asm(GQADecodeSpec(128, 128, dtype, kv, 0, "portable", "sm90", "gpu"), "v_words")
    regs = run_ptx(asm, {"$4": words})
    got = np.stack([regs[f"${i}"] for i in range(4)], 1)
    _check(got, codes, kv, "f16" if dtype == "fp16" else "bf16")


def test_the_model_rounds_and_permutes_as_ptx_does():
    """The modelled instructions on values worked by hand."""
    w = np.array([0x04030201], dtype=U32)
    assert run_ptx("{ prmt.b32 $0, $1, 0, 0x1404; }", {"$1": w})["$0"][0] == 0x02000100
    one, half = np.array([0x3C00], dtype=U32), np.array([0x3800], dtype=U32)
    assert run_ptx("{ sub.f16x2 $0, $1, $2; }", {"$1": one, "$2": half})["$0"][0] == 0x3800
    # e4m3 0x38 is 1.0, 0x7F NaN
    r = run_ptx("{ cvt.rn.f16x2.e4m3x2 $0, $1; }", {"$1": np.array([0x7F38], dtype=U32)})["$0"]
    assert r[0] & 0xFFFF == 0x3C00 and np.isnan(_half(r >> U32(16), "f16")[0])
    # bf16x2 from two fp32: 1.0 high, -2.0 low
    f = {"$1": np.array([0x3F800000], dtype=U32), "$2": np.array([0xC0000000], dtype=U32)}
    assert run_ptx("{ cvt.rn.bf16x2.f32 $0, $1, $2; }", f)["$0"][0] == 0x3F80C000
