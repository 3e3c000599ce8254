"""The wgmma decodes' dequantizers are PTX (inline asm, integer operations and multiplies, no
conversion instruction), which Triton's CPU interpreter cannot run. Here the PTX text of each
generated kernel is executed by a small interpreter of the instructions it uses, on every code
of each format, and compared bit for bit with the format's reference dequantization."""

import numpy as np
import pytest
import torch

from kvgen.codegen.render import render
from kvgen.families.mla_decode import MLADecodeDSMLASpec, MLADecodeFP8Spec, MLADecodeMXFP4Spec
from kvgen.formats import MXFP4, mla_cache, mxfp4

U32 = np.uint32


def _asm(spec, function):
    """The PTX string of ``function``'s inline_asm_elementwise in ``spec``'s generated source."""
    src = render(spec)
    body = src[src.index(f"def {function}(") :]
    return body[body.index('"""{') + 3 : body.index('}"""') + 1]


def _bf16_value(bits):
    """float64 values of bf16 bit patterns (uint32 holding 16 bits): exact, subnormals too."""
    return (bits.astype(U32) << U32(16)).view(np.float32).astype(np.float64)


def _round_bf16(x):
    """bf16 bits of float64 ``x`` rounded to nearest even (via fp32: exact for the products
    the dequantizers compute, which fit in 16 significant bits)."""
    f = np.asarray(x, dtype=np.float32).view(U32)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    r = ((f + U32(0x7FFF) + ((f >> U32(16)) & U32(1))) >> U32(16)) & U32(0xFFFF)
    return np.where(nan, (f >> U32(16)) | U32(0x40), r).astype(U32)


def _f32(bits):
    return bits.astype(U32).view(np.float32)


def _half_bits(x32):
    """fp16 bits of fp32 values, rounded to nearest even."""
    return np.asarray(x32, dtype=np.float32).astype(np.float16).view(np.uint16).astype(U32)


def _prmt(a, b, sel):
    src = [(a >> U32(8 * i)) & U32(0xFF) for i in range(4)]
    src += [(b >> U32(8 * i)) & U32(0xFF) for i in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = src[nib & 7]
        if nib & 8:  # sign replicate: the selected byte's top bit in all eight
            byte = np.where(byte & U32(0x80), U32(0xFF), U32(0))
        out |= byte << U32(8 * i)
    return out


def run_ptx(asm: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute ``asm`` (one block of the subset of PTX the dequantizers use) on uint32 arrays;
    ``inputs`` maps operands ($2, ...) to their values. Returns every register.

    Inline asm may give an output operand the register of an input, so the interpreter
    refuses an input read after an output was written."""
    written = []
    for line in asm.splitlines():
        ops = [o.strip() for o in line.strip().rstrip(";").partition(" ")[2].split(",")]
        if ops[0].startswith("$") and ops[0] not in inputs:
            written.append(ops[0])
        late = [o for o in ops[1:] if o in inputs and written]
        assert not late, f"{line.strip()!r} reads {late} after {written} was written"
    regs = dict(inputs)
    with np.errstate(over="ignore", invalid="ignore"):  # (inf and NaN results are modelled)
        for line in asm.splitlines():
            _step(line, regs, inputs)
    return regs


def _step(line, regs, inputs):
    """One instruction of ``run_ptx``."""
    line = line.strip().rstrip(";")
    if not line or line in "{}" or line.startswith(".reg"):
        return
    instr, _, rest = line.partition(" ")
    ops = [o.strip() for o in rest.split(",")]
    args = [U32(int(o, 0)) if o[0].isdigit() else regs[o] for o in ops[1:]]
    if instr == "mov.b32":
        r = np.broadcast_to(args[0], next(iter(inputs.values())).shape)
    elif instr == "prmt.b32":
        r = _prmt(args[0], args[1], int(ops[3], 0))
    elif instr == "shl.b32":
        r = args[0] << args[1]
    elif instr == "shr.b32":
        r = args[0] >> args[1]
    elif instr == "and.b32":
        r = args[0] & args[1]
    elif instr == "or.b32":
        r = args[0] | args[1]
    elif instr == "add.u32":
        r = args[0] + args[1]
    elif instr == "mad.lo.u32":
        r = args[0] * args[1] + args[2]
    elif instr == "mul.rn.bf16x2":
        m = U32(0xFFFF)
        lo, hi = (
            _round_bf16(_bf16_value((args[0] >> U32(s)) & m) * _bf16_value((args[1] >> U32(s)) & m))
            for s in (0, 16)
        )
        r = lo | (hi << U32(16))
    elif instr == "mul.rn.f32":
        r = (_f32(args[0]) * _f32(args[1])).view(U32)
    elif instr in ("cvt.rn.bf16x2.f32", "cvt.rn.f16x2.f32"):
        one = _round_bf16 if "bf16" in instr else _half_bits
        r = one(_f32(args[1]).astype(np.float64)) | (one(_f32(args[0])) << U32(16))
    else:
        raise AssertionError(f"instruction not modelled: {line}")
    regs[ops[0]] = np.asarray(r, dtype=U32)


def _bits(x: torch.Tensor, dtype) -> np.ndarray:
    return x.to(dtype).view(torch.int16).numpy().astype(np.uint16).astype(U32)


def _words(codes: np.ndarray) -> np.ndarray:
    """uint32 words of a [n, 4] byte array (byte 0 lowest)."""
    c = codes.astype(U32)
    return c[:, 0] | (c[:, 1] << U32(8)) | (c[:, 2] << U32(16)) | (c[:, 3] << U32(24))


def _all_bytes_in_every_position(rng):
    """Words holding every byte value in every position, and random words."""
    every = np.arange(256)
    rows = [np.roll(np.stack([every] * 4, 1), k, axis=0) for k in range(4)]
    rows.append(rng.integers(0, 256, size=(4096, 4)))
    return np.concatenate(rows)


def _pairs(out0, out1):
    """[n, 4] bf16 / fp16 bit patterns of codes 0-3 from the two pair words."""
    m = U32(0xFFFF)
    return np.stack([out0 & m, out0 >> U32(16), out1 & m, out1 >> U32(16)], 1)


def _same(got_bits, want: torch.Tensor, dtype):
    want_bits = _bits(want, dtype)
    nan = torch.isnan(want).numpy()
    assert np.array_equal(got_bits[~nan], want_bits[~nan])
    got_f = _bf16_value(got_bits) if dtype == torch.bfloat16 else got_bits
    if dtype == torch.bfloat16:  # NaN codes read as NaN
        assert np.isnan(got_f[nan]).all()


def test_fp8_ds_mla_words_are_the_reference_values():
    """Every e4m3fn code (the NaN ones included) times each power-of-two tile scale of the
    format's range, a NaN scale and 0 (the zero-filled keys past a sequence's end)."""
    asm = _asm(MLADecodeDSMLASpec(576, 512, "bf16", "wgmma"), "e4m3_words")
    rng = np.random.default_rng(0)
    codes = _all_bytes_in_every_position(rng)
    for scale in [2.0**e for e in (-13, -5, 0, 3, 7, 8, 40, 119)] + [float("nan"), 0.0]:
        s16 = _bits(torch.tensor([scale]), torch.bfloat16)[0]
        regs = run_ptx(
            asm, {"$2": _words(codes), "$3": np.full(len(codes), s16 | (s16 << 16), U32)}
        )
        got = _pairs(regs["$0"], regs["$1"])
        # the reference: code * scale_t (exact in bf16)
        value = torch.from_numpy(codes.astype(np.uint8)).view(torch.float8_e4m3fn).float()
        _same(got, value * scale, torch.bfloat16)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_per_tensor_fp8_words_are_the_reference_values(dtype):
    """Every e4m3fn code times k_scales that are not powers of two, rounded once to the queries'
    dtype, as ``dequantize_fp8_per_tensor`` then the cast; NaN codes NaN."""
    asm = _asm(MLADecodeFP8Spec(576, 512, dtype, "wgmma"), "e4m3_words")
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    rng = np.random.default_rng(1)
    codes = _all_bytes_in_every_position(rng)
    for k_scale in (1.0, 0.0123456, 3.3333333, 1e-3, 77.7):
        ks = np.full(len(codes), np.float32(k_scale), dtype=np.float32).view(U32)
        regs = run_ptx(asm, {"$2": _words(codes), "$3": ks})
        got = _pairs(regs["$0"], regs["$1"])
        rows = torch.from_numpy(codes.astype(np.uint8))
        want = mla_cache.dequantize_fp8_per_tensor(rows, torch.tensor([k_scale]))
        nan = torch.isnan(want).numpy()
        assert np.array_equal(got[~nan], _bits(want, torch_dtype)[~nan])
        if torch_dtype == torch.bfloat16:
            assert np.isnan(_bf16_value(got[nan])).all()
        else:
            assert ((got[nan] & 0x7C00) == 0x7C00).all() and (got[nan] & 0x3FF).all()


@pytest.mark.parametrize("group", MXFP4.groups)
def test_mxfp4_words_are_the_reference_values(group):
    """Every E2M1 code in every position of a word, times every E8M0 scale byte (0 and 0xFF
    included), against ``mxfp4.dequantize_rows``."""
    spec = MLADecodeMXFP4Spec(576, 512, "bf16", "wgmma", group=group)
    asm = _asm(spec, "e2m1_words")
    rng = np.random.default_rng(2)
    codes = _all_bytes_in_every_position(rng)  # 8 codes a word: every nibble pair
    words = _words(codes)
    for x in (0, 1, 60, 126, 127, 128, 200, 254, 255):
        b = U32(0x40 if x == 0 else x << 7)
        regs = run_ptx(asm, {"$4": words, "$5": np.full(len(words), b | (b << U32(16)), U32)})
        m = U32(0xFFFF)
        got = np.stack([regs[f"${i}"] >> U32(s) & m for i in range(4) for s in (0, 16)], 1)
        # reference rows: these 4 code bytes then zeros, with every group's scale byte x
        n = len(codes)
        row = np.zeros((n, mxfp4.row_bytes(512, group)), dtype=np.uint8)
        row[:, :4] = codes
        row[:, 256:] = x
        want = mxfp4.dequantize_rows(torch.from_numpy(row), 512, group)[:, :8]
        nan = torch.isnan(want).numpy()
        assert np.array_equal(got[~nan], _bits(want, torch.bfloat16)[~nan])
        assert np.isnan(_bf16_value(got[nan])).all()


def test_the_interpreter_models_each_instruction():
    """The interpreter's byte permute (sign replicate too) and bf16 multiply on known values,
    so that the tests above rest on a model of PTX, not on the dequantizers' own reasoning."""
    a, b = np.array([0x44332211], U32), np.array([0x88776655], U32)
    assert _prmt(a, b, 0x7654)[0] == 0x88776655 and _prmt(a, b, 0x3210)[0] == 0x44332211
    assert _prmt(a, b, 0x4567)[0] == 0x55667788
    c = np.array([0x000080F0], U32)  # bytes 0xF0 and 0x80: top bits set
    assert _prmt(c, b, 0x9180)[0] == 0xFF80FFF0
    assert _prmt(a, b, 0x9180)[0] == 0x00220011
    one, two = np.array([0x3F80], U32), np.array([0x4000], U32)
    regs = run_ptx(
        "mul.rn.bf16x2 d, $0, $1;", {"$0": one | (two << U32(16)), "$1": two | (two << U32(16))}
    )
    assert regs["d"][0] == 0x40804000  # (1 * 2, 2 * 2)
    tiny = np.array([0x0001], U32)  # bf16's least subnormal, 2^-133, times 2^120 = 2^-13
    regs = run_ptx("mul.rn.bf16x2 d, $0, $1;", {"$0": tiny, "$1": np.array([0x7B80], U32)})
    assert _bf16_value(regs["d"] & U32(0xFFFF))[0] == 2.0**-13
