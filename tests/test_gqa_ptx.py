"""The GQA decode's code conversions are PTX (inline asm), which Triton's CPU interpreter cannot
run. Here the PTX text of each generated GPU kernel's ``k_codes_f16`` (four codes to fp16) and
``v_words`` (a 32-bit word of four codes to the queries' dtype) is executed by the PTX model of
tests/_ptx.py on every code in every byte position, and compared bit for bit with the format's
values (NaN codes: NaN); and the rows variant's int4 lookups (``k_levels``, ``v_levels``) on
every code in every nibble position against the levels' fp16 terms."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _ptx import (
    U32,
    all_bytes_in_every_position,
    asm_of,
    bf16_value,
    bits,
    f16_value,
    pairs,
    run_ptx,
    words,
)

from kvgen.families.gqa_decode import GQADecodeSpec

CODES = {"int8": torch.int8, "fp8e4m3": torch.float8_e4m3fn, "fp8e5m2": torch.float8_e5m2}


def _check(got_bits: np.ndarray, codes: np.ndarray, kv: str, dtype: torch.dtype):
    want = torch.from_numpy(codes.astype(np.uint8)).view(CODES[kv]).float()
    nan = torch.isnan(want).numpy()
    assert np.array_equal(got_bits[~nan], bits(want, dtype)[~nan])
    value = bf16_value if dtype == torch.bfloat16 else f16_value
    assert np.isnan(value(got_bits[nan])).all()


@pytest.mark.parametrize("kv", ["int8", "fp8e4m3", "fp8e5m2"])
def test_k_codes_are_their_fp16_values(kv):
    codes = all_bytes_in_every_position(np.random.default_rng(0))
    asm = asm_of(GQADecodeSpec(128, 128, "bf16", kv, 0, "portable", "sm90", "gpu"), "k_codes_f16")
    regs = run_ptx(asm, {"$2": words(codes)})
    _check(pairs(regs["$0"], regs["$1"]), codes, kv, torch.float16)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("kv", ["int8", "fp8e4m3", "fp8e5m2"])
def test_v_words_are_their_values_in_the_queries_dtype(kv, dtype):
    codes = all_bytes_in_every_position(np.random.default_rng(1))
    asm = asm_of(GQADecodeSpec(128, 128, dtype, kv, 0, "portable", "sm90", "gpu"), "v_words")
    regs = run_ptx(asm, {"$4": words(codes)})
    got = np.stack([regs[f"${i}"] for i in range(4)], 1)
    _check(got, codes, kv, torch.float16 if dtype == "fp16" else torch.bfloat16)


def test_the_model_rounds_and_permutes_as_ptx_does():
    """The instructions these conversions add to the model, on values worked by hand."""
    w = np.array([0x04030201], dtype=U32)
    assert run_ptx("prmt.b32 d, $1, 0, 0x1404;", {"$1": w})["d"][0] == 0x02000100
    assert run_ptx("xor.b32 d, $1, 0x80808080;", {"$1": w})["d"][0] == 0x84838281
    # the high word of 0x04030201 * 2^16 and of 0xFFFFFFFF * 0xFFFFFFFF
    assert run_ptx("mul.hi.u32 d, $1, 65536;", {"$1": w})["d"][0] == 0x0403
    ones = np.array([0xFFFFFFFF], dtype=U32)
    assert run_ptx("mul.hi.u32 d, $1, $1;", {"$1": ones})["d"][0] == 0xFFFFFFFE
    one, half = np.array([0x3C00], dtype=U32), np.array([0x3800], dtype=U32)
    assert run_ptx("sub.f16x2 d, $1, $2;", {"$1": one, "$2": half})["d"][0] == 0x3800
    # bf16: 2 * -1 + 3 = 1 (low half), 0 * -1 + 0 = 0 (high half)
    fma = {"$1": np.array([0x4000], U32), "$2": np.array([0xBF80], U32),
           "$3": np.array([0x4040], U32)}  # fmt: skip
    assert run_ptx("fma.rn.bf16x2 d, $1, $2, $3;", fma)["d"][0] == 0x3F80
    # e4m3 0x38 is 1.0, 0x7F NaN
    r = run_ptx("cvt.rn.f16x2.e4m3x2 d, $1;", {"$1": np.array([0x7F38], dtype=U32)})["d"]
    assert r[0] & 0xFFFF == 0x3C00 and np.isnan(f16_value(r >> U32(16))[0])
    regs = run_ptx("mov.b32 {l, h}, $1;", {"$1": np.array([0xBEEF1234], dtype=U32)})
    assert regs["l"][0] == 0x1234 and regs["h"][0] == 0xBEEF
    assert run_ptx("cvt.f32.f16 f, $1;", {"$1": one})["f"][0] == 0x3F800000
    # bf16x2 from two fp32: 1.0 high, -2.0 low
    f = {"$1": np.array([0x3F800000], dtype=U32), "$2": np.array([0xC0000000], dtype=U32)}
    assert run_ptx("cvt.rn.bf16x2.f32 d, $1, $2;", f)["d"][0] == 0x3F80C000
    # a selector in a register (per element): byte 4, the sign of byte 4 (0xF0: all ones),
    # byte 0, the sign of byte 3 (0x04: all zeros)
    sel = {"$1": w, "$2": np.array([0xB0C4], dtype=U32), "$3": np.array([0xF0], dtype=U32)}
    assert run_ptx("prmt.b32 d, $1, $3, $2;", sel)["d"][0] == 0x0001FFF0
    halves = {"$1": np.array([0x1234], dtype=U32), "$2": np.array([0xBEEF], dtype=U32)}
    assert run_ptx("mov.b32 d, {$1, $2};", halves)["d"][0] == 0xBEEF1234
    # fp16: 1.5 * 2 = 3 (low half), 0.5 * -0.5 = -0.25 (high half)
    mul = {"$1": np.array([0x38003E00], U32), "$2": np.array([0xB8004000], U32)}
    assert run_ptx("mul.rn.f16x2 d, $1, $2;", mul)["d"][0] == 0xB4004200


def test_an_input_read_after_an_output_is_written_is_refused():
    """Inline asm may give an output the register of an input: the model refuses PTX that
    reads an input after writing an output (the e5m2 conversion once did)."""
    w = np.array([0x04030201], dtype=U32)
    with pytest.raises(AssertionError, match="after"):
        run_ptx("prmt.b32 $0, $2, 0, 0x1404;\nprmt.b32 $1, $2, 0, 0x3424;", {"$2": w})


# --- the rows variant's int4 form (byte-permute lookups of the levels)


def _int4_levels(nibbles: np.ndarray, terms: np.ndarray) -> np.ndarray:
    """fp16 bits of each sign-magnitude code's term (hi or lo) of its level."""
    magnitude = terms[nibbles & 7]
    return np.where(nibbles & 8, -magnitude, magnitude).astype(np.float16).view(np.uint16)


def _level_terms():
    """The f16 terms the rows variant's lookups hold, from the format's levels: K's
    f16(level / INT4_KEY_MU) (the quotient of the fp32 level, in float64, rounded once) and V's
    f16(level)."""
    from kvgen.families.gqa_decode import INT4_KEY_MU
    from kvgen.formats.per_token_head import INT4_LEVELS

    levels = np.array(INT4_LEVELS, dtype=np.float32)
    return (levels.astype(np.float64) / INT4_KEY_MU).astype(np.float16), levels.astype(np.float16)


def _nibble_words(rng) -> np.ndarray:
    """Words holding every code in every nibble position, and random words."""
    every = np.arange(16, dtype=np.uint64)
    spread = [sum(((every + k + j) % 16) << (4 * j) for j in range(8)) for k in range(16)]
    rand = rng.integers(0, 2**32, size=4096, dtype=np.uint64)
    return np.concatenate([*spread, rand]).astype(U32)


@pytest.mark.parametrize("group", [32, 128])
def test_int4_rows_k_levels_are_the_levels_over_mu_in_f16(group):
    """``k_levels``: each of a word's 8 codes as f16(level / INT4_KEY_MU), the sign on it; bit
    for bit."""
    w = _nibble_words(np.random.default_rng(2))
    spec = GQADecodeSpec(128, 128, "bf16", "int4", group, "rows", "sm90", "gpu")
    regs = run_ptx(asm_of(spec, "k_levels"), {"$8": w})
    k_terms, _ = _level_terms()
    for n in range(8):
        nib = (w >> U32(4 * n)) & U32(15)
        assert np.array_equal(regs[f"${n}"], _int4_levels(nib, k_terms).astype(U32)), n


def test_int4_rows_v_levels_are_the_levels_times_the_key_scales():
    """``v_levels``: the 4 codes of two keys' half-words as each channel's pair (key 2i, key
    2i + 1) of fp16 level (hi) times that key's fp16 scale (the two scales one word, key 2i's
    in its low half), rounded once; bit for bit."""
    rng = np.random.default_rng(3)
    w = _nibble_words(rng)
    h0, h1 = w & U32(0xFFFF), w >> U32(16)
    scales = rng.uniform(-12, 12, size=(2, w.size))
    s0, s1 = (np.exp2(x).astype(np.float16).view(np.uint16).astype(U32) for x in scales)
    spec = GQADecodeSpec(128, 128, "bf16", "int4", 32, "rows", "sm90", "gpu")
    regs = run_ptx(asm_of(spec, "v_levels"), {"$8": h0, "$9": h1, "$10": s0 | (s1 << U32(16))})
    _, v_terms = _level_terms()
    for j in range(4):
        for e, (h, s) in enumerate(((h0, s0), (h1, s1))):
            nib = (h >> U32(4 * j)) & U32(15)
            level = torch.from_numpy(_int4_levels(nib, v_terms).view(np.float16))
            scale = torch.from_numpy(s.astype(np.uint16).view(np.float16))
            want = (level * scale).numpy().view(np.uint16).astype(U32)  # (one fp16 rounding)
            assert np.array_equal(regs[f"${2 * j + e}"], want), (j, e)


def test_int4_rows_halves_f32_are_the_words_fp16_halves_in_fp32():
    """``halves_f32`` (a key's K scales from one load of its scale row): the low and the high
    half of each word as fp16, in fp32; every fp16 bit pattern in each half, bit for bit (NaN:
    NaN)."""
    every = np.arange(1 << 16, dtype=U32)
    w = every | (np.roll(every, 12345) << U32(16))
    spec = GQADecodeSpec(128, 128, "bf16", "int4", 32, "rows", "sm90", "gpu")
    regs = run_ptx(asm_of(spec, "halves_f32"), {"$2": w})
    for out, half in ((regs["$0"], w & U32(0xFFFF)), (regs["$1"], w >> U32(16))):
        want = half.astype(np.uint16).view(np.float16).astype(np.float32)
        got = out.view(np.float32)
        nan = np.isnan(want)
        assert np.array_equal(got[~nan].view(U32), want[~nan].view(U32))
        assert np.isnan(got[nan]).all() and nan.sum() == 2 * 1023


# --- the portable variant's int4 levels on the GPU (byte permutes of the fp32 levels' planes)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_int4_portable_levels_are_the_signed_fp32_levels(dtype):
    """``int4_levels`` (gpu target): four codes (one an input) as their signed fp32 levels, bit
    for bit (code 8 is -0.0), over every combination of four codes; the table operands from
    ``level_planes``."""
    from kvgen.formats.per_token_head import INT4_LEVELS

    spec = GQADecodeSpec(128, 128, dtype, "int4", 32, "portable", "sm90", "gpu")
    codes = np.indices((16,) * 4).reshape(4, -1).astype(U32)  # every four codes
    regs = run_ptx(asm_of(spec, "level_planes"), {"%nsmid": np.full(1, 132, dtype=U32)})
    # (pack 4: each argument is 4 operands; a plane's are its word 4 times)
    planes = {f"${8 + 4 * i + j}": np.broadcast_to(regs[f"${i}"], codes[0].shape)
              for i in range(8) for j in range(4)}  # fmt: skip
    out = run_ptx(asm_of(spec, "int4_levels"), {f"${4 + k}": codes[k] for k in range(4)} | planes)
    levels = np.array(INT4_LEVELS, dtype=np.float32)
    for k in range(4):
        magnitude = levels[codes[k] & 7]
        want = np.where(codes[k] & 8, -magnitude, magnitude).astype(np.float32).view(U32)
        assert np.array_equal(out[f"${k}"], want), k
