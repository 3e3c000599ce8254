"""The wgmma decodes' dequantizers are PTX (inline asm, integer operations and multiplies, no
conversion instruction), and so are the MLA rows variant's code conversions (cvt of e4m3
pairs), which Triton's CPU interpreter cannot run. Here the PTX text of each generated kernel
is executed by a small interpreter of the instructions it uses, on every code of each format,
and compared bit for bit with the format's reference dequantization."""

import numpy as np
import pytest
import torch
from _ptx import (
    U32,
    all_bytes_in_every_position,
    asm_of,
    bf16_value,
    bits,
    pairs,
    prmt,
    run_ptx,
    words,
)

from kvgen.families.mla_decode import MLADecodeDSMLASpec, MLADecodeFP8Spec, MLADecodeMXFP4Spec
from kvgen.formats import MXFP4, mla_cache, mxfp4


def _same(got_bits, want: torch.Tensor, dtype):
    want_bits = bits(want, dtype)
    nan = torch.isnan(want).numpy()
    assert np.array_equal(got_bits[~nan], want_bits[~nan])
    got_f = bf16_value(got_bits) if dtype == torch.bfloat16 else got_bits
    if dtype == torch.bfloat16:  # NaN codes read as NaN
        assert np.isnan(got_f[nan]).all()


def test_fp8_ds_mla_words_are_the_reference_values():
    """Every e4m3fn code (the NaN ones included) times each power-of-two tile scale of the
    format's range, a NaN scale and 0 (the zero-filled keys past a sequence's end)."""
    asm = asm_of(MLADecodeDSMLASpec(576, 512, "bf16", "wgmma"), "e4m3_words")
    rng = np.random.default_rng(0)
    codes = all_bytes_in_every_position(rng)
    for scale in [2.0**e for e in (-13, -5, 0, 3, 7, 8, 40, 119)] + [float("nan"), 0.0]:
        s16 = bits(torch.tensor([scale]), torch.bfloat16)[0]
        regs = run_ptx(asm, {"$2": words(codes), "$3": np.full(len(codes), s16 | (s16 << 16), U32)})
        got = pairs(regs["$0"], regs["$1"])
        # the reference: code * scale_t (exact in bf16)
        value = torch.from_numpy(codes.astype(np.uint8)).view(torch.float8_e4m3fn).float()
        _same(got, value * scale, torch.bfloat16)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_per_tensor_fp8_words_are_the_reference_values(dtype):
    """Every e4m3fn code times k_scales that are not powers of two, rounded once to the queries'
    dtype, as ``dequantize_fp8_per_tensor`` then the cast; NaN codes NaN."""
    asm = asm_of(MLADecodeFP8Spec(576, 512, dtype, "wgmma"), "e4m3_words")
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    rng = np.random.default_rng(1)
    codes = all_bytes_in_every_position(rng)
    for k_scale in (1.0, 0.0123456, 3.3333333, 1e-3, 77.7):
        ks = np.full(len(codes), np.float32(k_scale), dtype=np.float32).view(U32)
        regs = run_ptx(asm, {"$2": words(codes), "$3": ks})
        got = pairs(regs["$0"], regs["$1"])
        rows = torch.from_numpy(codes.astype(np.uint8))
        want = mla_cache.dequantize_fp8_per_tensor(rows, torch.tensor([k_scale]))
        nan = torch.isnan(want).numpy()
        assert np.array_equal(got[~nan], bits(want, torch_dtype)[~nan])
        if torch_dtype == torch.bfloat16:
            assert np.isnan(bf16_value(got[nan])).all()
        else:
            assert ((got[nan] & 0x7C00) == 0x7C00).all() and (got[nan] & 0x3FF).all()


@pytest.mark.parametrize("group", MXFP4.groups)
def test_mxfp4_words_are_the_reference_values(group):
    """Every E2M1 code in every position of a word, times every E8M0 scale byte (0 and 0xFF
    included), against ``mxfp4.dequantize_rows``."""
    spec = MLADecodeMXFP4Spec(576, 512, "bf16", "wgmma", group=group)
    asm = asm_of(spec, "e2m1_words")
    rng = np.random.default_rng(2)
    codes = all_bytes_in_every_position(rng)  # 8 codes a word: every nibble pair
    ws = words(codes)
    for x in (0, 1, 60, 126, 127, 128, 200, 254, 255):
        # the kernel's e8m0_bf16_pair: 2^(X - 127) in bf16, 0xFF as bf16's NaN
        b = U32(0x40 if x == 0 else 0x7FC0 if x == 255 else x << 7)
        regs = run_ptx(asm, {"$4": ws, "$5": np.full(len(ws), b | (b << U32(16)), U32)})
        m = U32(0xFFFF)
        got = np.stack([regs[f"${i}"] >> U32(s) & m for i in range(4) for s in (0, 16)], 1)
        # reference rows: these 4 code bytes then zeros, with every group's scale byte x
        n = len(codes)
        row = np.zeros((n, mxfp4.row_bytes(512, group)), dtype=np.uint8)
        row[:, :4] = codes
        row[:, 256:] = x
        want = mxfp4.dequantize_rows(torch.from_numpy(row), 512, group)[:, :8]
        nan = torch.isnan(want).numpy()
        assert np.array_equal(got[~nan], bits(want, torch.bfloat16)[~nan])
        assert np.isnan(bf16_value(got[nan])).all()


def test_the_interpreter_models_each_instruction():
    """The interpreter's byte permute (sign replicate too) and bf16 multiply on known values,
    so that the tests above rest on a model of PTX, not on the dequantizers' own reasoning."""
    a, b = np.array([0x44332211], U32), np.array([0x88776655], U32)
    assert prmt(a, b, 0x7654)[0] == 0x88776655 and prmt(a, b, 0x3210)[0] == 0x44332211
    assert prmt(a, b, 0x4567)[0] == 0x55667788
    c = np.array([0x000080F0], U32)  # bytes 0xF0 and 0x80: top bits set
    assert prmt(c, b, 0x9180)[0] == 0xFF80FFF0
    assert prmt(a, b, 0x9180)[0] == 0x00220011
    one, two = np.array([0x3F80], U32), np.array([0x4000], U32)
    regs = run_ptx(
        "mul.rn.bf16x2 d, $0, $1;", {"$0": one | (two << U32(16)), "$1": two | (two << U32(16))}
    )
    assert regs["d"][0] == 0x40804000  # (1 * 2, 2 * 2)
    tiny = np.array([0x0001], U32)  # bf16's least subnormal, 2^-133, times 2^120 = 2^-13
    regs = run_ptx("mul.rn.bf16x2 d, $0, $1;", {"$0": tiny, "$1": np.array([0x7B80], U32)})
    assert bf16_value(regs["d"] & U32(0xFFFF))[0] == 2.0**-13


# --- the rows variant (keys as the MMAs' rows): e4m3 codes to fp16 in the A registers


def _f16_nan_aware(got_bits: np.ndarray, codes: np.ndarray):
    """fp16 bits against each e4m3fn code's value (exact in fp16; NaN codes NaN)."""
    want = torch.from_numpy(codes.astype(np.uint8)).view(torch.float8_e4m3fn).float()
    nan = torch.isnan(want).numpy()
    assert np.array_equal(got_bits[~nan], bits(want, torch.float16)[~nan])
    got = (got_bits & U32(0xFFFF)).astype(np.uint16).view(np.float16)
    assert np.isnan(got[nan]).all()


def test_rows_e4m3_quads_are_the_codes_values():
    """``e4m3_quads``: a word's four codes as fp16, byte q to output q; every code in every
    byte position."""
    asm = asm_of(MLADecodeDSMLASpec(576, 512, "bf16", "rows", "sm90", "gpu"), "e4m3_quads")
    codes = all_bytes_in_every_position(np.random.default_rng(4))
    regs = run_ptx(asm, {"$4": words(codes)})
    _f16_nan_aware(np.stack([regs[f"${q}"] for q in range(4)], 1), codes)


def test_rows_wide_e4m3_half_pairs_pair_two_keys_codes():
    """``e4m3_half_pairs`` (the wide kernel's V operand): two codes (channels c, c + 1) of key k
    (h0, a half-word) and of key k + 1 (h1) as fp16, in the order (c of k, c of k + 1, c + 1 of
    k, c + 1 of k + 1); every code in every position."""
    spec = MLADecodeDSMLASpec(576, 512, "bf16", "rows", "sm90", "gpu")
    asm = asm_of(spec, "e4m3_half_pairs")
    codes = all_bytes_in_every_position(np.random.default_rng(6))  # [n, 4]: h0's 2, h1's 2
    h0 = codes[:, 0].astype(U32) | (codes[:, 1].astype(U32) << U32(8))
    h1 = codes[:, 2].astype(U32) | (codes[:, 3].astype(U32) << U32(8))
    regs = run_ptx(asm, {"$4": h0, "$5": h1})
    for out, (col, key) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
        _f16_nan_aware(regs[f"${out}"], codes[:, 2 * key + col])


def test_rows_e4m3_key_pairs_pair_two_keys_codes():
    """``e4m3_key_pairs``: byte q of w0 and of w1 (one channel of two keys) as fp16, in the
    order (q0 w0, q0 w1, q1 w0, q1 w1, ...) that puts a channel's two keys in one register."""
    asm = asm_of(MLADecodeDSMLASpec(576, 512, "bf16", "rows", "sm90", "gpu"), "e4m3_key_pairs")
    rng = np.random.default_rng(5)
    c0 = all_bytes_in_every_position(rng)
    c1 = np.roll(c0, 7, axis=0)
    regs = run_ptx(asm, {"$8": words(c0), "$9": words(c1)})
    for q in range(4):
        _f16_nan_aware(regs[f"${2 * q}"], c0[:, q])
        _f16_nan_aware(regs[f"${2 * q + 1}"], c1[:, q])
