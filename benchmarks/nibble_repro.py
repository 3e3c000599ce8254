"""The portable 4-bit decodes' nibble unpacking alone, at 16- to 64-key tiles, against torch.

On sm90 the portable MXFP4 MLA and int4 GQA decodes are wrong at 16-key tiles (every row,
every channel block: ``results/sm90/nibble-tile-check-h100-2026-12-06.txt``) and right at 32,
while the interpreter's builds are right at both. This kernel does only what both decodes do
with a tile of keys' packed codes (bytes to int32, ``tl.join`` of the low and high nibbles,
a reshape to (keys, groups, channels), a level per code, times a per-group scale, a reshape to
(keys, channels)), then the two products of a decode step, S = Q K^T and O = P K, and prints
each run's relative error against the same steps in torch (fp32). The other forms build the
same K without some of those steps (the kernel's docstring), to tell which step Triton builds
wrong. On an H100 (``results/sm90/nibble-repro-forms-h100-2026-12-06.txt``) O is wrong at 16
keys and 16- or 32-row tiles (and 64 rows at 2 warps) for the nibbles and asm forms, S right
everywhere; the join, gather and direct forms are right at every tile. The flat and unscaled
forms (the nibbles' join without the 3-D reshape, and without the scale) are wrong at the same
tiles (``results/sm90/nibble-repro-flat-unscaled-h100-2026-12-06.txt``): neither the reshape
around the scale nor the scale product is the trigger, but the join of the int32 nibbles and
their levels, where a join of two fp16 halves is right. A form Triton fails to build (the
join form at 64-row tiles and 4 or 8 warps: its TritonGPUOptimizeDotOperands pass fails) prints
BUILD FAILED and the run goes on.

    python -P benchmarks/nibble_repro.py [--forms nibbles asm join gather direct flat unscaled]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl

D = tl.constexpr(128)  # channels a key (constexprs: the kernel reads them)
GROUPS = tl.constexpr(4)  # scale groups of 32 channels
CHANNELS = tl.constexpr(32)
_D, _GROUPS, _CHANNELS = D.value, GROUPS.value, CHANNELS.value


# The levels of four codes ($4-$7) into $0-$3: the codes' magnitudes looked up in a byte
# table by one prmt, then each byte to fp32, negated where its code's bit 3 is set.
_ELEMENT = """
        shr.b32 x, t, {shift};
        and.b32 x, x, 0xFF;
        cvt.rn.f32.u32 ${out}, x;
        and.b32 y, ${code}, 8;
        setp.ne.u32 p, y, 0;
        @p neg.f32 ${out}, ${out};"""
LEVELS_ASM = tl.constexpr(
    """{
        .reg .b32 s, m, t, x, y, lo, hi;
        .reg .pred p;
        shl.b32 s, $5, 4;
        or.b32 s, s, $4;
        shl.b32 t, $6, 8;
        or.b32 s, s, t;
        shl.b32 t, $7, 12;
        or.b32 s, s, t;
        and.b32 m, s, 0x7777;
        mov.b32 lo, 0x03020100;
        mov.b32 hi, 0x07060504;
        prmt.b32 t, lo, hi, m;"""
    + "".join(_ELEMENT.format(out=j, code=4 + j, shift=8 * j) for j in range(4))
    + "\n        }"
)


@triton.jit
def _levels_asm(codes):
    """Each 4-bit code's level (code & 7, negated where bit 3 is set) as fp32, four codes an
    asm instance (``pack=4``), the magnitudes looked up in a byte table by ``prmt``."""
    return tl.inline_asm_elementwise(
        LEVELS_ASM, "=f,=f,=f,=f,r,r,r,r", [codes], dtype=tl.float32, is_pure=True, pack=4
    )


@triton.jit
def _levels(codes):
    mag = (codes & 7).to(tl.float32)
    return tl.where((codes & 8) != 0, -mag, mag)


FORMS = ("nibbles", "asm", "join", "gather", "direct", "flat", "unscaled")


@triton.jit
def _kernel(codes_ptr, scale_ptr, k_ptr, q_ptr, p_ptr, s_ptr, o_ptr,
            BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, FORM: tl.constexpr):  # fmt: skip
    """K (BLOCK_N keys x D channels, fp16) built as FORM says, then S = Q K^T and O = P K.

    0 nibbles: bytes to int32, join of the low and high nibbles, reshape to (keys, groups,
    channels), levels, times the group scale, reshape to (keys, D), as both decodes do;
    1 asm: the same with the levels by inline asm (pack=4); 2 join: the join and reshape alone,
    of two fp16 halves (even and odd channels) loaded from the reference K; 3 gather: the
    codes read per channel (byte c // 2, shifted by 4 (c & 1)), no join and no reshape;
    4 direct: the reference K loaded as it is; 5 flat: the nibbles' join reshaped straight to
    (keys, D), levels, times the scale read per channel (no 3-D reshape); 6 unscaled: as
    nibbles without the scale product (the run passes scales of 1)."""
    n = tl.arange(0, BLOCK_N)
    h = tl.arange(0, BLOCK_H)
    c = tl.arange(0, D)
    if FORM <= 1 or FORM == 6:
        b = tl.arange(0, D // 2)
        codes = tl.load(codes_ptr + n[:, None] * (D // 2) + b[None, :]).to(tl.int32)
        codes = tl.reshape(tl.join(codes & 0xF, codes >> 4), (BLOCK_N, GROUPS, CHANNELS))
        g = tl.arange(0, GROUPS)
        scale = tl.load(scale_ptr + n[:, None] * GROUPS + g[None, :])
        if FORM == 1:
            vals = _levels_asm(codes)
        else:
            vals = _levels(codes)
        if FORM == 6:
            k = tl.reshape(vals, (BLOCK_N, D)).to(tl.float16)
        else:
            k = tl.reshape(vals * scale[:, :, None], (BLOCK_N, D)).to(tl.float16)
    elif FORM == 5:
        b = tl.arange(0, D // 2)
        codes = tl.load(codes_ptr + n[:, None] * (D // 2) + b[None, :]).to(tl.int32)
        codes = tl.reshape(tl.join(codes & 0xF, codes >> 4), (BLOCK_N, D))
        scale = tl.load(scale_ptr + n[:, None] * GROUPS + (c // CHANNELS)[None, :])
        k = (_levels(codes) * scale).to(tl.float16)
    elif FORM == 2:
        half = tl.arange(0, D // 2)
        rows = k_ptr + n[:, None] * D + 2 * half[None, :]
        k = tl.reshape(tl.join(tl.load(rows), tl.load(rows + 1)), (BLOCK_N, D))
    elif FORM == 3:
        byte = tl.load(codes_ptr + n[:, None] * (D // 2) + (c // 2)[None, :]).to(tl.int32)
        codes = (byte >> (4 * (c & 1))[None, :]) & 0xF
        scale = tl.load(scale_ptr + n[:, None] * GROUPS + (c // CHANNELS)[None, :])
        k = (_levels(codes) * scale).to(tl.float16)
    else:
        k = tl.load(k_ptr + n[:, None] * D + c[None, :])
    q = tl.load(q_ptr + h[:, None] * D + c[None, :])
    s = tl.dot(q, tl.trans(k))
    tl.store(s_ptr + h[:, None] * BLOCK_N + n[None, :], s)
    p = tl.load(p_ptr + h[:, None] * BLOCK_N + n[None, :])
    o = tl.dot(p, k)
    tl.store(o_ptr + h[:, None] * D + c[None, :], o)


def reference(codes, scale):
    """The keys' values: channel 2i in byte i's low nibble, 2i + 1 in its high one."""
    lo, hi = (codes & 0xF).int(), (codes >> 4).int()
    nib = torch.stack((lo, hi), dim=-1).reshape(codes.shape[0], _D)
    mag = (nib & 7).float()
    vals = torch.where((nib & 8) != 0, -mag, mag)
    return (vals.reshape(-1, _GROUPS, _CHANNELS) * scale[:, :, None]).reshape(-1, _D)


def run(block_n, block_h, warps, form, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    codes = torch.randint(0, 256, (block_n, _D // 2), generator=gen, dtype=torch.uint8)
    scale = torch.rand(block_n, _GROUPS, generator=gen) + 0.5
    if form == "unscaled":
        scale = torch.ones_like(scale)
    q = torch.randn(block_h, _D, generator=gen).half()
    p = torch.rand(block_h, block_n, generator=gen).half()
    k = reference(codes, scale).half()
    s_ref, o_ref = q.float() @ k.float().T, p.float() @ k.float()
    args = [x.to(device) for x in (codes, scale, k, q, p)]
    s = torch.full((block_h, block_n), float("nan"), device=device)
    o = torch.full((block_h, _D), float("nan"), device=device)
    _kernel[(1,)](*args, s, o, BLOCK_N=block_n, BLOCK_H=block_h, FORM=FORMS.index(form),
                  num_warps=warps)  # fmt: skip
    s, o = s.cpu(), o.cpu()
    err = [float((x - r).abs().max() / r.abs().max()) for x, r in ((s, s_ref), (o, o_ref))]
    return err


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--forms", nargs="+", choices=FORMS, default=list(FORMS),
        help="how K is built (the kernel's docstring); default: each in turn",
    )  # fmt: skip
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    if args.device == "cuda" and torch.cuda.is_available():
        print(f"{torch.cuda.get_device_name()}, Triton {triton.__version__}")
    grid = itertools.product(args.forms, (16, 32, 64), (16, 32, 64), (2, 4, 8))
    for form, block_n, block_h, warps in grid:
        head = f"{form:7s} block_n {block_n:2d} block_h {block_h:2d} warps {warps}:"
        try:
            s_err, o_err = run(block_n, block_h, warps, form, args.device)
        except RuntimeError as exc:  # Triton's pass manager failing is a finding here too
            print(f"{head} BUILD FAILED ({str(exc).splitlines()[-1][:80]})", flush=True)
            continue
        bad = "  WRONG" if max(s_err, o_err) > 1e-2 else ""
        print(f"{head} S rel err {s_err:.1e}, O rel err {o_err:.1e}{bad}", flush=True)


if __name__ == "__main__":
    main()
