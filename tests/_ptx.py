"""A small model of the PTX that kvgen's dequantizers are written in (inline asm, which
Triton's CPU interpreter cannot run): the instructions they use, executed on numpy uint32
arrays (a 16-bit register holds its bits in the low half), so that tests can run the PTX text of
each generated kernel on every code of a format and compare bit for bit with the reference."""

from __future__ import annotations

import numpy as np
import torch

from kvgen.codegen.render import render

U32 = np.uint32


def asm_of(spec, function: str) -> str:
    """The PTX string (a ``\"\"\"{ ... }\"\"\"`` block) of ``function``'s inline_asm_elementwise in
    ``spec``'s generated source."""
    src = render(spec)
    body = src[src.index(f"def {function}(") :]
    return body[body.index('"""{') + 3 : body.index('}"""') + 1]


def bf16_value(bits):
    """float64 values of bf16 bit patterns (uint32 holding 16 bits): exact, subnormals too."""
    return (bits.astype(U32) << U32(16)).view(np.float32).astype(np.float64)


def f16_value(bits):
    """float64 values of fp16 bit patterns (uint32 holding 16 bits)."""
    return (bits & U32(0xFFFF)).astype(np.uint16).view(np.float16).astype(np.float64)


def round_bf16(x):
    """bf16 bits of float64 ``x`` rounded to nearest even (via fp32: exact for the products
    the dequantizers compute, which fit in 16 significant bits)."""
    f = np.asarray(x, dtype=np.float32).view(U32)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    r = ((f + U32(0x7FFF) + ((f >> U32(16)) & U32(1))) >> U32(16)) & U32(0xFFFF)
    return np.where(nan, (f >> U32(16)) | U32(0x40), r).astype(U32)


def f32(bits):
    return bits.astype(U32).view(np.float32)


def half_bits(x32):
    """fp16 bits of fp32 values, rounded to nearest even."""
    return np.asarray(x32, dtype=np.float32).astype(np.float16).view(np.uint16).astype(U32)


def prmt(a, b, sel):
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


def prmt_by(a, b, sel):
    """``prmt`` with a selector per element (a register, not an immediate)."""
    src = np.stack([(x >> U32(8 * i)) & U32(0xFF) for x in (a, b) for i in range(4)])
    out = np.zeros_like(a)
    for i in range(4):
        nib = (sel >> U32(4 * i)) & U32(0xF)
        byte = np.take_along_axis(src, (nib & U32(7)).astype(np.intp)[None], axis=0)[0]
        byte = np.where(nib & U32(8), np.where(byte & U32(0x80), U32(0xFF), U32(0)), byte)
        out |= byte << U32(8 * i)
    return out


def _operands(line):
    """(instruction, destinations, sources) of one line; ``{a, b}`` is a register pair."""
    instr, _, rest = line.strip().rstrip(";").partition(" ")
    if rest.startswith("{"):  # mov.b32 {lo, hi}, word: a word split into its halves
        pair, _, src = rest.partition("},")
        return instr, [r.strip() for r in pair.strip("{ ").split(",")], [src.strip()]
    if "{" in rest:  # mov.b32 word, {lo, hi}: a word made of two halves
        dest, _, pair = rest.partition(",")
        return instr, [dest.strip()], [r.strip() for r in pair.strip(" {}").split(",")]
    ops = [o.strip() for o in rest.split(",")]
    return instr, ops[:1], ops[1:]


def run_ptx(asm: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute ``asm`` (one block of the subset of PTX the dequantizers use, an instruction a
    line) on uint32 arrays; ``inputs`` maps operands ($2, ...) and special registers
    (``%nsmid``) to their values. Returns every register.

    Inline asm may give an output operand the register of an input, so the interpreter
    refuses an input read after an output was written."""
    lines = [ln.strip() for ln in asm.splitlines()]
    lines = [ln for ln in lines if ln and ln not in "{}" and not ln.startswith(".reg")]
    written = []
    for line in lines:
        _, dests, srcs = _operands(line)
        written += [d for d in dests if d.startswith("$") and d not in inputs]
        late = [o for o in srcs if o in inputs and written]
        assert not late, f"{line!r} reads {late} after {written} was written"
    regs = dict(inputs)
    with np.errstate(over="ignore", invalid="ignore"):  # (inf and NaN results are modelled)
        for line in lines:
            _step(line, regs, inputs)
    return regs


def _pairwise(args, value, round_, op):
    """A .x2 instruction: ``op`` on each 16-bit half, rounded back to 16 bits."""
    m = U32(0xFFFF)
    lo, hi = (round_(op(*(value((a >> U32(s)) & m) for a in args))) for s in (0, 16))
    return lo | (hi << U32(16))


def _step(line, regs, inputs):
    """One instruction of ``run_ptx``."""
    instr, dests, srcs = _operands(line)
    shape = next(iter(inputs.values())).shape
    args = [np.broadcast_to(U32(int(o, 0)), shape) if o[0].isdigit() else regs[o] for o in srcs]
    if instr == "mov.b32" and len(dests) == 2:
        regs[dests[0]], regs[dests[1]] = args[0] & U32(0xFFFF), args[0] >> U32(16)
        return
    if instr == "mov.b32" and len(args) == 2:  # {lo, hi}: the halves' low 16 bits
        regs[dests[0]] = (args[0] & U32(0xFFFF)) | ((args[1] & U32(0xFFFF)) << U32(16))
        return
    if instr in ("mov.b32", "mov.u32"):
        r = args[0]
    elif instr == "prmt.b32" and srcs[2][0].isdigit():
        r = prmt(args[0], args[1], int(srcs[2], 0))
    elif instr == "prmt.b32":
        r = prmt_by(args[0], args[1], args[2])
    elif instr == "shl.b32":
        r = args[0] << args[1]
    elif instr in ("shr.b32", "shr.u32"):
        r = args[0] >> args[1]
    elif instr == "and.b32":
        r = args[0] & args[1]
    elif instr == "or.b32":
        r = args[0] | args[1]
    elif instr == "xor.b32":
        r = args[0] ^ args[1]
    elif instr == "add.u32":
        r = args[0] + args[1]
    elif instr == "mad.lo.u32":
        r = args[0] * args[1] + args[2]
    elif instr == "mul.hi.u32":  # the high 32 bits of the 64-bit product
        r = (args[0].astype(np.uint64) * args[1].astype(np.uint64)) >> np.uint64(32)
    elif instr == "mul.rn.bf16x2":
        r = _pairwise(args, bf16_value, round_bf16, lambda a, b: a * b)
    elif instr == "fma.rn.bf16x2":
        r = _pairwise(args, bf16_value, round_bf16, lambda a, b, c: a * b + c)
    elif instr == "sub.f16x2":
        r = _pairwise(args, f16_value, half_bits, lambda a, b: a - b)
    elif instr == "mul.rn.f16x2":  # (a product of two fp16 values is exact in fp32)
        r = _pairwise(args, f16_value, half_bits, lambda a, b: a * b)
    elif instr == "mul.rn.f32":
        r = (f32(args[0]) * f32(args[1])).view(U32)
    elif instr in ("cvt.rn.bf16x2.f32", "cvt.rn.f16x2.f32"):  # d = {cvt(a) high, cvt(b) low}
        one = round_bf16 if "bf16" in instr else half_bits
        r = one(f32(args[1]).astype(np.float64)) | (one(f32(args[0])) << U32(16))
    elif instr == "cvt.rn.f16x2.e4m3x2":  # the low byte's value in the low half
        e4m3 = [((args[0] >> U32(s)) & U32(0xFF)).astype(np.uint8) for s in (0, 8)]
        lo, hi = (half_bits(torch.from_numpy(b).view(torch.float8_e4m3fn).float()) for b in e4m3)
        r = lo | (hi << U32(16))
    elif instr == "cvt.f32.f16":
        r = f16_value(args[0]).astype(np.float32).view(U32)
    else:
        raise AssertionError(f"instruction not modelled: {line}")
    regs[dests[0]] = np.asarray(r, dtype=U32)


def bits(x: torch.Tensor, dtype) -> np.ndarray:
    return x.to(dtype).view(torch.int16).numpy().astype(np.uint16).astype(U32)


def words(codes: np.ndarray) -> np.ndarray:
    """uint32 words of a [n, 4] byte array (byte 0 lowest)."""
    c = codes.astype(U32)
    return c[:, 0] | (c[:, 1] << U32(8)) | (c[:, 2] << U32(16)) | (c[:, 3] << U32(24))


def all_bytes_in_every_position(rng):
    """Words holding every byte value in every position, and random words."""
    every = np.arange(256)
    rows = [np.roll(np.stack([every] * 4, 1), k, axis=0) for k in range(4)]
    rows.append(rng.integers(0, 256, size=(4096, 4)))
    return np.concatenate(rows)


def pairs(out0, out1):
    """[n, 4] bf16 / fp16 bit patterns of codes 0-3 from the two pair words."""
    m = U32(0xFFFF)
    return np.stack([out0 & m, out0 >> U32(16), out1 & m, out1 >> U32(16)], 1)
