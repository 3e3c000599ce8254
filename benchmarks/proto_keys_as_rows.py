"""Experiment: the fp8_ds_mla MLA decode with the keys as the MMA's rows (sm90, Gluon).

The wgmma decode (mla_decode_wgmma) pads the query heads to the MMA's 64 rows: at 16 heads
4x the MMA work, Q re-read from shared memory every tile, and the dequantized K written to
shared memory and handed between warpgroups. Here the roles are swapped:

    S^T [64 keys, H] = K [64 keys, 576] . Q^T
    O^T [512, H]    += V^T [512, 64 keys] . P^T         (A = V^T, dequantized into registers)

so H (16 or 32 heads) is the MMAs' N and nothing but P is written to shared memory.

- S, two ways (S_FP8). 1: e4m3 MMAs with both operands in shared memory: A = the staged
  codes as they are, B = q split into two e4m3 parts, q = hi + lo (hi = q rounded to e4m3, lo
  = what that rounding left, 4 more bits: exact for every bf16 value within 2^10 of its head's
  largest after a power-of-two scale per head), no conversion instruction and no register
  operand. 0: K dequantized into the A registers (cvt.rn.f16x2.e4m3x2, fp16 MMAs), the
  contraction index permuted to what a thread loads in one piece (Q^T's rows permuted to
  match), q in fp16 scaled by a power of two per head.
- V^T is dequantized into the A registers (fp16), each thread's 4 channels of 4 keys from
  one word a key, the output channels permuted to match and put back in order at the end.
- The fp8_ds_mla scales stay out of the MMAs: S = the sum over the four 128-channel tiles of
  scale_t * (codes_t . q_t), and P is multiplied by scale_t / top_t (top_t: a running largest
  scale of tile t), the O accumulator of tile t rescaled when top_t moves, as the softmax's
  running max moves. LAZY: those references move only when a score is more than 8 above its
  head's or a scale more than 2^7 times its tile's (P stays within fp16), so most pages leave
  O and the sums alone.
- A page comes by three TMA copies (the codes as one 3-D box [4 tiles, 64 keys, 128 bytes],
  the scales, the RoPE part), each on its own mbarrier, issued at the top of the page before:
  Triton's membar pass puts a CTA barrier between operations on one barrier object, so one
  object a part costs one barrier a page, not one a copy. Each warp reduces its 16 keys'
  largest score and scales, and one exchange through shared memory gives the page's.

One program a (sequence, split) with 4 warps; page 64 (a tile is a page); s_q 1; no causal
rows. A split's partial (out, lse) are merged by a small Triton kernel. keys_as_rows_2wg_kernel
(--wgs 2) runs the e4m3 S with lazy references on 8 warps: S's heads split between the two
warpgroups, V^T's channels split between them (half of O a thread).

    python benchmarks/proto_keys_as_rows.py [--heads 16,32] [--splits 2] [--bufs 2]
        [--async 0,1] [--s-fp8 0,1] [--lazy 0,1] [--wgs 1,2] [--json F]

It times the kernel beside kvgen's bf16 decode (over the bf16 cache the fp8_ds_mla one was
stored from) and its wgmma fp8_ds_mla decode, in one process, and checks each against a float64
reference over the dequantized cache (the bf16 row's error is therefore the quantization's).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

PAGE = gl.constexpr(64)  # keys a tile, = the page
ROW_BYTES = 656  # fp8_ds_mla's record: 512 codes, 4 fp32 scales, 64 bf16 RoPE channels


@gluon.constexpr_function
def mma_layout(n, warps, k=16):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                     instr_shape=[16, n, k])  # fmt: skip


@gluon.constexpr_function
def a_layout(n):
    return gl.DotOperandLayout(operand_index=0, parent=mma_layout(n, 4), k_width=2)


# A thread (warp w, lane 4g + c) of the S MMA's A operand holds keys 16w + g (+ 8): as staged
# words [64 keys, 32 words] (a scale tile's 128 codes), words 8c .. 8c + 7 of those keys.
K_WORDS = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
        lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]],
        block_bases=[],
        shape=[64, 32],
    )
)
# The V^T MMA's A operand: thread (w, 4g + c) holds channel word 8w + g (channels
# 4(8w + g) .. + 3 of the scale tile) of keys 2c, 2c + 1 (+ 8, + 16, + 32, ...).
V_WORDS = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [8, 0], [16, 0], [32, 0]],
        lane_bases=[[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[[0, 8], [0, 16]],
        block_bases=[],
        shape=[64, 32],
    )
)


@gluon.constexpr_function
def warps_by_heads(h):
    """[4 warps, h] whole in every thread, the heads (columns) as the S MMA's accumulator holds
    them: bit 0 and bits 3.. in registers, bits 1-2 in the lane."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [1, 0], [2, 0]] + [[0, 8 << j] for j in range(h.bit_length() - 4)],
        lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
        warp_bases=[[0, 0], [0, 0]],
        block_bases=[],
        shape=[4, h],
    )


@gluon.jit
def e4m3_quads(w):
    """The four e4m3fn codes of each word as fp16 (exact)."""
    return gl.inline_asm_elementwise(
        """{
        .reg .b16 a, b;
        .reg .b32 f0, f1;
        mov.b32 {a, b}, $4;
        cvt.rn.f16x2.e4m3x2 f0, a;
        cvt.rn.f16x2.e4m3x2 f1, b;
        mov.b32 {$0, $1}, f0;
        mov.b32 {$2, $3}, f1;
        }""",
        "=h,=h,=h,=h,r",
        [w],
        dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
        is_pure=True,
        pack=1,
    )


@gluon.jit
def e4m3_key_pairs(w0, w1):
    """Byte q of word w0 and of word w1 (the same channel of two keys) as fp16, q = 0..3:
    (q0 w0, q0 w1, q1 w0, q1 w1, ...)."""
    return gl.inline_asm_elementwise(
        """{
        .reg .b16 a, b, c, d;
        .reg .b32 r0, r1, f;
        prmt.b32 r0, $8, $9, 0x5140;
        prmt.b32 r1, $8, $9, 0x7362;
        mov.b32 {a, b}, r0;
        mov.b32 {c, d}, r1;
        cvt.rn.f16x2.e4m3x2 f, a;
        mov.b32 {$0, $1}, f;
        cvt.rn.f16x2.e4m3x2 f, b;
        mov.b32 {$2, $3}, f;
        cvt.rn.f16x2.e4m3x2 f, c;
        mov.b32 {$4, $5}, f;
        cvt.rn.f16x2.e4m3x2 f, d;
        mov.b32 {$6, $7}, f;
        }""",
        "=h,=h,=h,=h,=h,=h,=h,=h,r,r",
        [w0, w1],
        dtype=(gl.float16,) * 8,
        is_pure=True,
        pack=1,
    )


@gluon.jit
def k_operand(codes, H: gl.constexpr):
    """A scale tile's codes [64 keys, 32 words] as the S MMA's A operand [64, 128] fp16, its
    column j = 16s + 8p + 2c + e holding channel 32c + 4s + 2p + e."""
    w = codes.load(K_WORDS)
    e0, e1, e2, e3 = e4m3_quads(w)
    x = gl.join(gl.join(e0, e1), gl.join(e2, e3))  # [key, word, e, p]
    x = x.reshape([64, 4, 8, 2, 2]).permute((0, 2, 4, 1, 3)).reshape([64, 128])
    return gl.convert_layout(x, a_layout(H))


@gluon.jit
def v_operand(codes, H: gl.constexpr):
    """A scale tile's codes as the V^T MMA's A operand [128, 64 keys] fp16: row
    64 sub + 16w + 8h + g holds channel 32w + 4g + 2 sub + h."""
    w = codes.load(V_WORDS)
    w0, w1 = gl.split(w.reshape([32, 2, 32]).permute((0, 2, 1)))  # keys 2kk, 2kk + 1
    a0, b0, a1, b1, a2, b2, a3, b3 = e4m3_key_pairs(w0, w1)
    # byte q = 2 sub + h; [kk, word, e, h] a sub
    s0 = gl.join(gl.join(a0, b0), gl.join(a1, b1))
    s1 = gl.join(gl.join(a2, b2), gl.join(a3, b3))
    x = gl.join(s0, s1)  # [kk, word, e, h, sub]; word = 8w + g
    x = x.reshape([32, 4, 8, 2, 2, 2]).permute((5, 1, 4, 2, 0, 3)).reshape([128, 64])
    return gl.convert_layout(x, a_layout(H))


@gluon.jit
def issue_tile(descs, bufs, bars, row):
    """A page's three parts, each on its own mbarrier: every mbarrier operation and copy on one
    barrier object is ordered by a CTA barrier (Triton's membar pass), so three objects cost one
    barrier a page where one object cost one a copy."""
    codes_desc, scale_desc, rope_desc = descs
    codes_s, scale_s, rope_s = bufs
    bar_c, bar_s, bar_r = bars
    mbarrier.expect(bar_c, 4 * 64 * 128)
    mbarrier.expect(bar_s, 64 * 16)
    mbarrier.expect(bar_r, 64 * 128)
    tma.async_copy_global_to_shared(codes_desc, [0, row, 0], bar_c, codes_s)  # [4, 64, 128]
    tma.async_copy_global_to_shared(scale_desc, [row, 128], bar_s, scale_s)
    tma.async_copy_global_to_shared(rope_desc, [row, 264], bar_r, rope_s)


@gluon.jit
def issue_next(i, n_tiles, NUM_BUF: gl.constexpr, descs, stages, bars_all, pages, t_lo, page_next):
    """The copy NUM_BUF - 1 pages ahead of page i, into the stage page i - 1 read (every warp is
    done with it past the barrier at the top of page i); returns the page index after it."""
    codes3_s, scale_s, rope_s = stages
    ready_c, ready_s, ready_r = bars_all
    nxt = i + NUM_BUF - 1
    if nxt < n_tiles:
        ns = nxt % NUM_BUF
        bufs = (codes3_s.index(ns), scale_s.index(ns), rope_s.index(ns))
        bars = (ready_c.index(ns), ready_s.index(ns), ready_r.index(ns))
        issue_tile(descs, bufs, bars, page_next * PAGE)
    return gl.load(pages + t_lo + nxt + 1, mask=nxt + 1 < n_tiles, other=0)


@gluon.jit
def page_range(seqlens_ptr, b, split, SPLITS: gl.constexpr):
    """(the sequence's length, its split's first page, the split's pages)."""
    seqlen = gl.load(seqlens_ptr + b)
    tiles = (seqlen + PAGE - 1) // PAGE
    per = (tiles + SPLITS - 1) // SPLITS
    t_lo = split * per
    t_hi = gl.minimum(t_lo + per, tiles)
    return seqlen, t_lo, gl.maximum(t_hi - t_lo, 0)


@gluon.jit
def staging(NUM_BUF: gl.constexpr):
    """The ring a page's three parts land in, and their mbarriers (initialised): a page's codes
    by one 3-D copy [4 scale tiles, 64 keys, 128 bytes] (the kernels view the same bytes as
    e4m3 tiles or words), its scales and its RoPE part."""
    c3_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=3)
    codes3_s = gl.allocate_shared_memory(gl.float8e4nv, [NUM_BUF, 4, 64, 128], c3_sl)
    scale_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 4], gl.float32)
    scale_s = gl.allocate_shared_memory(gl.float32, [NUM_BUF, 64, 4], scale_sl)
    rope_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    rope_s = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, 64, 64], rope_sl)
    ready_c = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    ready_s = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    ready_r = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready_c.index(i), count=1)
        mbarrier.init(ready_s.index(i), count=1)
        mbarrier.init(ready_r.index(i), count=1)
    return (codes3_s, scale_s, rope_s), (ready_c, ready_s, ready_r)


@gluon.jit
def first_copies(descs, stages, bars_all, pages, t_lo, n_tiles, NUM_BUF: gl.constexpr):
    """The copies of the split's first NUM_BUF - 1 pages; returns the page index after them
    (loaded a page ahead of its copy, its latency off the loop's path)."""
    codes3_s, scale_s, rope_s = stages
    ready_c, ready_s, ready_r = bars_all
    for i in gl.static_range(NUM_BUF - 1):
        if i < n_tiles:
            page = gl.load(pages + t_lo + i)
            bufs = (codes3_s.index(i), scale_s.index(i), rope_s.index(i))
            bars = (ready_c.index(i), ready_s.index(i), ready_r.index(i))
            issue_tile(descs, bufs, bars, page * PAGE)
    return gl.load(pages + t_lo + (NUM_BUF - 1), mask=NUM_BUF - 1 < n_tiles, other=0)


@gluon.jit
def wait_page(bars_all, stage, phase):
    ready_c, ready_s, ready_r = bars_all
    mbarrier.wait(ready_s.index(stage), phase)
    mbarrier.wait(ready_r.index(stage), phase)
    mbarrier.wait(ready_c.index(stage), phase)


@gluon.constexpr_function
def scale_layout(warps):
    """A page's scales [64 keys, 4 tiles]: a thread holds the 4 scales of the keys its S
    accumulator rows are (warps past 4 hold copies)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]],
        lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]] + [[0, 0]] * (warps.bit_length() - 3),
        block_bases=[],
        shape=[64, 4],
    )


@gluon.constexpr_function
def tops_layout(warps):
    """[4 row-warps, 4 scale tiles] whole in every thread."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [1, 0], [2, 0]],
        lane_bases=[[0, 0], [0, 0], [0, 0], [0, 0], [0, 0]],
        warp_bases=[[0, 0]] * (warps.bit_length() - 1),
        block_bases=[],
        shape=[4, 4],
    )


@gluon.jit
def page_scales(scale_stage, n_valid, SC_L: gl.constexpr, KEYS: gl.constexpr):
    """A page's scales (0 past the length) and each key's four power-of-two scales in the S
    accumulator's key layout: as one word of exponent bytes (one layout conversion, not four;
    a NaN scale becomes +inf, which still makes the tile NaN)."""
    sc_cols = gl.arange(0, 4, layout=gl.SliceLayout(0, SC_L))
    sc = scale_stage.load(SC_L)
    sc = gl.where((gl.arange(0, 64, layout=gl.SliceLayout(1, SC_L)) < n_valid)[:, None], sc, 0.0)
    ex = (sc.to(gl.int32, bitcast=True) >> 23) << (8 * sc_cols[None, :])
    ex = gl.convert_layout(gl.sum(ex, axis=1), KEYS)
    sc0 = ((ex & 0xFF) << 23).to(gl.float32, bitcast=True)
    sc1 = (((ex >> 8) & 0xFF) << 23).to(gl.float32, bitcast=True)
    sc2 = (((ex >> 16) & 0xFF) << 23).to(gl.float32, bitcast=True)
    sc3 = (((ex >> 24) & 0xFF) << 23).to(gl.float32, bitcast=True)
    return sc, sc0, sc1, sc2, sc3


@gluon.jit
def s_fp8_mmas(codes8_s, c0, q_s, zero8):
    """The page's four scale tiles' S parts, codes . (q_hi + q_lo), issued asynchronously."""
    p0 = warpgroup_mma(codes8_s.index(c0 + 0), q_s.index(0).permute((1, 0)), zero8, is_async=True)
    p0 = warpgroup_mma(codes8_s.index(c0 + 0), q_s.index(1).permute((1, 0)), p0, is_async=True)
    p1 = warpgroup_mma(codes8_s.index(c0 + 1), q_s.index(2).permute((1, 0)), zero8, is_async=True)
    p1 = warpgroup_mma(codes8_s.index(c0 + 1), q_s.index(3).permute((1, 0)), p1, is_async=True)
    p2 = warpgroup_mma(codes8_s.index(c0 + 2), q_s.index(4).permute((1, 0)), zero8, is_async=True)
    p2 = warpgroup_mma(codes8_s.index(c0 + 2), q_s.index(5).permute((1, 0)), p2, is_async=True)
    p3 = warpgroup_mma(codes8_s.index(c0 + 3), q_s.index(6).permute((1, 0)), zero8, is_async=True)
    p3 = warpgroup_mma(codes8_s.index(c0 + 3), q_s.index(7).permute((1, 0)), p3, is_async=True)
    return p0, p1, p2, p3


@gluon.jit
def page_tops(red_t, TOP_L: gl.constexpr, SC_L: gl.constexpr):
    """Each scale tile's largest scale in the page, from the warps' exchanged ones."""
    sc_cols = gl.arange(0, 4, layout=gl.SliceLayout(0, SC_L))
    tops = gl.convert_layout(gl.max(red_t.load(TOP_L), axis=0), gl.SliceLayout(0, SC_L))
    tt0 = gl.sum(gl.where(sc_cols == 0, tops, 0.0), axis=0)
    tt1 = gl.sum(gl.where(sc_cols == 1, tops, 0.0), axis=0)
    tt2 = gl.sum(gl.where(sc_cols == 2, tops, 0.0), axis=0)
    tt3 = gl.sum(gl.where(sc_cols == 3, tops, 0.0), axis=0)
    return tt0, tt1, tt2, tt3


@gluon.jit
def lazy_tops(tts, tops):
    """A scale tile's reference moves only when the page's largest scale is more than 2^7
    times it (p * scale / top < 2^15, within fp16)."""
    tt0, tt1, tt2, tt3 = tts
    top0, top1, top2, top3 = tops
    return (
        gl.where(tt0 > top0 * 128.0, tt0, top0),
        gl.where(tt1 > top1 * 128.0, tt1, top1),
        gl.where(tt2 > top2 * 128.0, tt2, top2),
        gl.where(tt3 > top3 * 128.0, tt3, top3),
    )


@gluon.jit
def store_p(p, scales, tops, p_bufs):
    """P of each scale tile (p * scale_t / top_t, fp16) into its own allocation, transposed
    (the PV MMAs' B)."""
    sc0, sc1, sc2, sc3 = scales
    new0, new1, new2, new3 = tops
    p0_s, p1_s, p2_s, p3_s = p_bufs
    p0_s.store((p * (sc0 / new0)[:, None]).to(gl.float16).permute((1, 0)))
    p1_s.store((p * (sc1 / new1)[:, None]).to(gl.float16).permute((1, 0)))
    p2_s.store((p * (sc2 / new2)[:, None]).to(gl.float16).permute((1, 0)))
    p3_s.store((p * (sc3 / new3)[:, None]).to(gl.float16).permute((1, 0)))


@gluon.jit
def keys_as_rows_kernel(q_ptr, table_ptr, seqlens_ptr, o_part_ptr, lse_part_ptr,
                        stride_qb, stride_tb, scale_log2, codes_desc, scale_desc, rope_desc,
                        H: gl.constexpr, SPLITS: gl.constexpr, NUM_BUF: gl.constexpr,
                        ASYNC: gl.constexpr, S_FP8: gl.constexpr, LAZY: gl.constexpr):  # fmt: skip
    b = gl.program_id(0)
    split = gl.program_id(1)
    seqlen, t_lo, n_tiles = page_range(seqlens_ptr, b, split, SPLITS)

    S_L: gl.constexpr = mma_layout(H, 4)
    KEYS: gl.constexpr = gl.SliceLayout(1, S_L)
    HEADS: gl.constexpr = gl.SliceLayout(0, S_L)

    # --- Q: fp16, scaled by 2^-e per head, its latent channels permuted as k_operand's
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    hq = gl.arange(0, H, layout=gl.SliceLayout(1, QL))
    ch = gl.arange(0, 512, layout=gl.SliceLayout(0, QL))
    q_base = q_ptr + b.to(gl.int64) * stride_qb + hq[:, None] * 576
    q_lat = gl.load(q_base + ch[None, :]).to(gl.float32)
    top = gl.max(gl.abs(q_lat), axis=1)
    # fp16: top < 2^(expo + 14); e4m3 parts: top < 2^(expo + 8)
    expo = ((top.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127 + 1 - (8 if S_FP8 else 14)
    expo = gl.minimum(gl.maximum(expo, -100), 100)
    q_scale = ((127 - expo) << 23).to(gl.float32, bitcast=True)  # 2^-expo
    q_unscale = ((127 + expo) << 23).to(gl.float32, bitcast=True)
    jj = gl.arange(0, 128, layout=gl.SliceLayout(0, QL))
    if S_FP8:
        # q = hi + lo, both e4m3 (exact for every bf16 value within 2^10 of the head's
        # largest: lo holds the 4 bits that hi's rounding left); the codes are the S MMAs' A
        # operand straight from the staged bytes, channels in their own order
        q8_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, 128], gl.float8e4nv)
        q_s = gl.allocate_shared_memory(gl.float8e4nv, [8, H, 128], q8_sl)
        for t in gl.static_range(4):
            x = gl.load(q_base + 128 * t + jj[None, :]).to(gl.float32) * q_scale[:, None]
            hi = x.to(gl.float8e4nv)
            q_s.index(2 * t).store(hi)
            q_s.index(2 * t + 1).store((x - hi.to(gl.float32)).to(gl.float8e4nv))
    else:
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, 128], gl.float16)
        q_s = gl.allocate_shared_memory(gl.float16, [4, H, 128], q_sl)
        perm = 32 * ((jj >> 1) & 3) + 4 * (jj >> 4) + 2 * ((jj >> 3) & 1) + (jj & 1)
        for t in gl.static_range(4):
            x = gl.load(q_base + 128 * t + perm[None, :]).to(gl.float32) * q_scale[:, None]
            q_s.index(t).store(x.to(gl.float16))
    RL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    hr = gl.arange(0, H, layout=gl.SliceLayout(1, RL))
    cr = gl.arange(0, 64, layout=gl.SliceLayout(0, RL))
    qr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, 64], gl.bfloat16)
    qr_s = gl.allocate_shared_memory(gl.bfloat16, [H, 64], qr_sl)
    qr_s.store(gl.load(q_ptr + b.to(gl.int64) * stride_qb + hr[:, None] * 576 + 512 + cr[None, :]))
    q_unscale = gl.convert_layout(q_unscale, HEADS)

    # --- the staging ring (TMA) and P; the codes seen as e4m3 tiles (the S MMAs' A) and as
    # words (the K / V^T operands' loads), one 128-byte swizzle
    stages, bars_all = staging(NUM_BUF)
    codes3_s, scale_s, rope_s = stages
    c8_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], gl.float8e4nv)
    codes8_s = codes3_s._reinterpret(gl.float8e4nv, [NUM_BUF * 4, 64, 128], c8_sl)
    codes_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 32], gl.int32)
    codes_s = codes3_s._reinterpret(gl.int32, [NUM_BUF * 4, 64, 32], codes_sl)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, 64], gl.float16)
    # P of each scale tile in its own allocation (the membar pass orders stores to one
    # allocation by CTA barriers)
    p0_s = gl.allocate_shared_memory(gl.float16, [H, 64], p_sl)
    p1_s = gl.allocate_shared_memory(gl.float16, [H, 64], p_sl)
    p2_s = gl.allocate_shared_memory(gl.float16, [H, 64], p_sl)
    p3_s = gl.allocate_shared_memory(gl.float16, [H, 64], p_sl)
    # each warp's largest score per head and scale per scale tile, exchanged once a page
    red_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    red_m = gl.allocate_shared_memory(gl.float32, [4, H], red_sl)
    red_t = gl.allocate_shared_memory(gl.float32, [4, 4], red_sl)
    fence_async_shared()
    gl.thread_barrier()
    descs = (codes_desc, scale_desc, rope_desc)
    pages = table_ptr + b.to(gl.int64) * stride_tb
    page_next = first_copies(descs, stages, bars_all, pages, t_lo, n_tiles, NUM_BUF)

    SC_L: gl.constexpr = scale_layout(4)
    # [4 warps, H] and [4 warps, 4] read whole by every thread, heads as S_L's columns
    RED_L: gl.constexpr = warps_by_heads(H)
    TOP_L: gl.constexpr = tops_layout(4)
    key = gl.arange(0, 64, layout=KEYS)
    O_L: gl.constexpr = S_L
    o0 = gl.zeros([128, H], gl.float32, O_L)
    o1 = gl.zeros([128, H], gl.float32, O_L)
    o2 = gl.zeros([128, H], gl.float32, O_L)
    o3 = gl.zeros([128, H], gl.float32, O_L)
    top0 = 0.0
    top1 = 0.0
    top2 = 0.0
    top3 = 0.0
    m_i = gl.full([H], -float("inf"), gl.float32, HEADS)
    l_p = gl.zeros([64, H], gl.float32, S_L)  # each thread's share of the sums
    a_rope: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S_L, k_width=2)
    for i in range(n_tiles):
        stage = i % NUM_BUF
        # every warp is done with page i - 1 (its MMAs waited for) past this barrier; the
        # next copy is issued while the S MMAs run (the issuing thread waits for the copy
        # engine, and every warp would wait for it at the next barrier)
        gl.thread_barrier()
        if not S_FP8:
            page_next = issue_next(i, n_tiles, NUM_BUF, descs, stages, bars_all, pages, t_lo,
                                   page_next)  # fmt: skip
        wait_page(bars_all, stage, (i // NUM_BUF) & 1)
        c0 = 4 * stage
        n_valid = seqlen - (t_lo + i) * PAGE
        valid = key < n_valid
        sc, sc0, sc1, sc2, sc3 = page_scales(scale_s.index(stage), n_valid, SC_L, KEYS)
        zero = gl.zeros([64, H], gl.float32, S_L)
        if S_FP8:  # every S MMA's operands in shared memory: issued together, one wait
            s = warpgroup_mma(rope_s.index(stage), qr_s.permute((1, 0)), zero, is_async=True)
            zero8 = gl.zeros([64, H], gl.float32, mma_layout(H, 4, 32))
            p0, p1, p2, p3 = s_fp8_mmas(codes8_s, c0, q_s, zero8)
            page_next = issue_next(i, n_tiles, NUM_BUF, descs, stages, bars_all, pages, t_lo,
                                   page_next)  # fmt: skip
            s, p0, p1, p2, p3 = warpgroup_mma_wait(0, deps=[s, p0, p1, p2, p3])
            p0 = gl.convert_layout(p0, S_L)  # (the same registers: k is not in the mapping)
            p1 = gl.convert_layout(p1, S_L)
            p2 = gl.convert_layout(p2, S_L)
            p3 = gl.convert_layout(p3, S_L)
            lat = p0 * sc0[:, None] + p1 * sc1[:, None] + p2 * sc2[:, None] + p3 * sc3[:, None]
        elif ASYNC:  # each A operand built while the MMA before it runs
            ar = rope_s.index(stage).load(a_rope)
            s = warpgroup_mma(ar, qr_s.permute((1, 0)), zero, is_async=True)
            ka = k_operand(codes_s.index(c0 + 0), H)
            p0 = warpgroup_mma(ka, q_s.index(0).permute((1, 0)), zero, is_async=True)
            s, ar = warpgroup_mma_wait(1, deps=[s, ar])
            kb = k_operand(codes_s.index(c0 + 1), H)
            p1 = warpgroup_mma(kb, q_s.index(1).permute((1, 0)), zero, is_async=True)
            p0, ka = warpgroup_mma_wait(1, deps=[p0, ka])
            ka = k_operand(codes_s.index(c0 + 2), H)
            p2 = warpgroup_mma(ka, q_s.index(2).permute((1, 0)), zero, is_async=True)
            p1, kb = warpgroup_mma_wait(1, deps=[p1, kb])
            kb = k_operand(codes_s.index(c0 + 3), H)
            p3 = warpgroup_mma(kb, q_s.index(3).permute((1, 0)), zero, is_async=True)
            p2, ka = warpgroup_mma_wait(1, deps=[p2, ka])
            p3, kb = warpgroup_mma_wait(0, deps=[p3, kb])
            lat = p0 * sc0[:, None] + p1 * sc1[:, None] + p2 * sc2[:, None] + p3 * sc3[:, None]
        else:
            s = warpgroup_mma(rope_s.index(stage).load(a_rope), qr_s.permute((1, 0)), zero)
            part = warpgroup_mma(
                k_operand(codes_s.index(c0 + 0), H), q_s.index(0).permute((1, 0)), zero
            )
            lat = part * sc0[:, None]
            part = warpgroup_mma(
                k_operand(codes_s.index(c0 + 1), H), q_s.index(1).permute((1, 0)), zero
            )
            lat += part * sc1[:, None]
            part = warpgroup_mma(
                k_operand(codes_s.index(c0 + 2), H), q_s.index(2).permute((1, 0)), zero
            )
            lat += part * sc2[:, None]
            part = warpgroup_mma(
                k_operand(codes_s.index(c0 + 3), H), q_s.index(3).permute((1, 0)), zero
            )
            lat += part * sc3[:, None]
        z = (lat * q_unscale[None, :] + s) * scale_log2
        z = gl.where(valid[:, None], z, -float("inf"))
        # the page's largest score per head and scale per scale tile: each warp's over its 16
        # keys, then one exchange
        red_m.store(gl.max(gl.reshape(z, [4, 16, H]), axis=1))
        red_t.store(gl.max(gl.reshape(sc, [4, 16, 4]), axis=1))
        gl.thread_barrier()
        m_tile = gl.convert_layout(gl.max(red_m.load(RED_L), axis=0), HEADS)
        tt0, tt1, tt2, tt3 = page_tops(red_t, TOP_L, SC_L)
        if LAZY:
            # The references move only when a score is more than 8 above its head's (p < 2^8)
            # or a scale more than 2^7 times its scale tile's: most pages then leave O and the
            # sums as they are.
            m_new = gl.where((m_tile > m_i + 8.0) | (m_tile != m_tile), m_tile, m_i)
            new0, new1, new2, new3 = lazy_tops((tt0, tt1, tt2, tt3), (top0, top1, top2, top3))
        else:
            m_new = gl.maximum(m_i, m_tile)
            new0 = gl.maximum(top0, tt0)
            new1 = gl.maximum(top1, tt1)
            new2 = gl.maximum(top2, tt2)
            new3 = gl.maximum(top3, tt3)
        p = gl.exp2(z - m_new[None, :])
        moved = gl.max((m_new != m_i).to(gl.int32), axis=0)
        moved = moved | (new0 != top0) | (new1 != top1) | (new2 != top2) | (new3 != top3)
        if moved:
            alpha = gl.exp2(m_i - m_new)
            l_p = l_p * alpha[None, :]
            o0 = o0 * (alpha * (top0 / new0))[None, :]
            o1 = o1 * (alpha * (top1 / new1))[None, :]
            o2 = o2 * (alpha * (top2 / new2))[None, :]
            o3 = o3 * (alpha * (top3 / new3))[None, :]
        l_p = l_p + p
        m_i = m_new
        store_p(p, (sc0, sc1, sc2, sc3), (new0, new1, new2, new3), (p0_s, p1_s, p2_s, p3_s))
        fence_async_shared()
        gl.thread_barrier()  # every warp's P in, every warp done with the stage read last
        if ASYNC:
            va = v_operand(codes_s.index(c0 + 0), H)
            o0 = warpgroup_mma(va, p0_s.permute((1, 0)), o0, is_async=True)
            vb = v_operand(codes_s.index(c0 + 1), H)
            o1 = warpgroup_mma(vb, p1_s.permute((1, 0)), o1, is_async=True)
            o0, va = warpgroup_mma_wait(1, deps=[o0, va])
            va = v_operand(codes_s.index(c0 + 2), H)
            o2 = warpgroup_mma(va, p2_s.permute((1, 0)), o2, is_async=True)
            o1, vb = warpgroup_mma_wait(1, deps=[o1, vb])
            vb = v_operand(codes_s.index(c0 + 3), H)
            o3 = warpgroup_mma(vb, p3_s.permute((1, 0)), o3, is_async=True)
            o2, va = warpgroup_mma_wait(1, deps=[o2, va])
            o3, vb = warpgroup_mma_wait(0, deps=[o3, vb])
        else:
            o0 = warpgroup_mma(v_operand(codes_s.index(c0 + 0), H), p0_s.permute((1, 0)), o0)
            o1 = warpgroup_mma(v_operand(codes_s.index(c0 + 1), H), p1_s.permute((1, 0)), o1)
            o2 = warpgroup_mma(v_operand(codes_s.index(c0 + 2), H), p2_s.permute((1, 0)), o2)
            o3 = warpgroup_mma(v_operand(codes_s.index(c0 + 3), H), p3_s.permute((1, 0)), o3)
        top0 = new0
        top1 = new1
        top2 = new2
        top3 = new3
        # (every MMA of the page is waited for above: the next page's stores of P follow the
        # exchange's barrier)

    # --- partial out (normalised) and lse (log2) of this split
    l_i = gl.sum(l_p, axis=0)
    inv_l = gl.where(l_i > 0.0, 1.0 / l_i, 0.0)
    lse2 = gl.where(l_i > 0.0, m_i + gl.log2(l_i), -float("inf"))
    heads = gl.arange(0, H, layout=HEADS)
    mo = gl.arange(0, 128, layout=gl.SliceLayout(1, O_L))
    # row 64 sub + 16w + 8h + g -> channel 32w + 4g + 2 sub + h of the scale tile
    chan = 32 * ((mo >> 4) & 3) + 4 * (mo & 7) + 2 * (mo >> 6) + ((mo >> 3) & 1)
    # partial out as [channel, head] (a thread's two adjacent heads in one store, whole
    # 32-byte sectors); the combine kernel reads it so
    base = o_part_ptr + (b * SPLITS + split).to(gl.int64) * 512 * H + heads[None, :]
    gl.store(base + chan[:, None] * H, o0 * (top0 * inv_l)[None, :])
    gl.store(base + (128 + chan[:, None]) * H, o1 * (top1 * inv_l)[None, :])
    gl.store(base + (256 + chan[:, None]) * H, o2 * (top2 * inv_l)[None, :])
    gl.store(base + (384 + chan[:, None]) * H, o3 * (top3 * inv_l)[None, :])
    gl.store(lse_part_ptr + (b * SPLITS + split) * H + heads, lse2)


# --- two warpgroups (8 warps): S's heads split between them, O^T's channels split between them


@gluon.constexpr_function
def mma_layout_2d(n, warps_m, warps_n, k=16):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps_m, warps_n],
                                     instr_shape=[16, n // warps_n, k])  # fmt: skip


@gluon.constexpr_function
def rows_by_heads(h, warps_n, warps):
    """[4 row-warps, h] whole in every thread, the heads as an MMA accumulator of warps_n
    warpgroups along N holds them: bit 0 and bits 3.. of a warpgroup's h / warps_n in
    registers, bits 1-2 in the lane, the warpgroup bit in the warp."""
    hn = h // warps_n
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [1, 0], [2, 0]] + [[0, 8 << j] for j in range(hn.bit_length() - 4)],
        lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
        warp_bases=[[0, 0]] * (warps.bit_length() - 1 - (warps_n - 1)) + [[0, hn]] * (warps_n - 1),
        block_bases=[],
        shape=[4, h],
    )


# The V^T MMA's A operand over 8 warps (M = a scale tile's 128 channels): thread (w, 4g + c)
# holds half-word 8w + g (channels 16w + 2g, + 1) of keys 2c, 2c + 1 (+ 8, + 16, + 32).
V_HALVES = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [8, 0], [16, 0], [32, 0]],
        lane_bases=[[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[[0, 8], [0, 16], [0, 32]],
        block_bases=[],
        shape=[64, 64],
    )
)


@gluon.jit
def e4m3_half_pairs(h0, h1):
    """Two e4m3 codes (channels c, c + 1) of key k (h0) and of key k + 1 (h1) as fp16:
    (c of k, c of k + 1, c + 1 of k, c + 1 of k + 1)."""
    return gl.inline_asm_elementwise(
        """{
        .reg .b32 r, f;
        .reg .b16 lo, hi;
        mov.b32 r, {$4, $5};
        prmt.b32 r, r, 0, 0x3120;
        mov.b32 {lo, hi}, r;
        cvt.rn.f16x2.e4m3x2 f, lo;
        mov.b32 {$0, $1}, f;
        cvt.rn.f16x2.e4m3x2 f, hi;
        mov.b32 {$2, $3}, f;
        }""",
        "=h,=h,=h,=h,h,h",
        [h0, h1],
        dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
        is_pure=True,
        pack=1,
    )


@gluon.jit
def v_operand_2wg(codes, a_layout: gl.constexpr):
    """A scale tile's codes [64 keys, 64 half-words] as the V^T MMA's A operand [128, 64 keys]
    over 8 warps: row 16w + 8h + g holds channel 16w + 2g + h."""
    w = codes.load(V_HALVES)
    w0, w1 = gl.split(w.reshape([32, 2, 64]).permute((0, 2, 1)))  # keys 2kk, 2kk + 1
    a0, b0, a1, b1 = e4m3_half_pairs(w0, w1)
    x = gl.join(gl.join(a0, b0), gl.join(a1, b1))  # [kk, half-word 8w + g, e, h]
    x = x.reshape([32, 8, 8, 2, 2]).permute((1, 4, 2, 0, 3)).reshape([128, 64])
    return gl.convert_layout(x, a_layout)


@gluon.jit
def keys_as_rows_2wg_kernel(q_ptr, table_ptr, seqlens_ptr, o_part_ptr, lse_part_ptr,
                            stride_qb, stride_tb, scale_log2, codes_desc, scale_desc, rope_desc,
                            H: gl.constexpr, SPLITS: gl.constexpr,
                            NUM_BUF: gl.constexpr):  # fmt: skip
    """keys_as_rows_kernel's e4m3 S with lazy references on 8 warps: the S MMAs' N (heads)
    split between the two warpgroups, the V^T MMAs' M (a scale tile's channels) split between
    them, so a thread holds half of O and converts half of a page's codes."""
    b = gl.program_id(0)
    split = gl.program_id(1)
    seqlen, t_lo, n_tiles = page_range(seqlens_ptr, b, split, SPLITS)

    S_L: gl.constexpr = mma_layout_2d(H, 4, 2)  # [64 keys, H]
    S8_L: gl.constexpr = mma_layout_2d(H, 4, 2, 32)
    O_L: gl.constexpr = mma_layout_2d(H, 8, 1)  # [128 channels of a scale tile, H]
    A_V: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    KEYS: gl.constexpr = gl.SliceLayout(1, S_L)
    HEADS: gl.constexpr = gl.SliceLayout(0, S_L)
    HEADS_O: gl.constexpr = gl.SliceLayout(0, O_L)

    QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    hq = gl.arange(0, H, layout=gl.SliceLayout(1, QL))
    ch = gl.arange(0, 512, layout=gl.SliceLayout(0, QL))
    q_base = q_ptr + b.to(gl.int64) * stride_qb + hq[:, None] * 576
    top = gl.max(gl.abs(gl.load(q_base + ch[None, :]).to(gl.float32)), axis=1)
    expo = ((top.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127 + 1 - 8
    expo = gl.minimum(gl.maximum(expo, -100), 100)
    q_scale = ((127 - expo) << 23).to(gl.float32, bitcast=True)
    q_unscale = gl.convert_layout(((127 + expo) << 23).to(gl.float32, bitcast=True), HEADS)
    jj = gl.arange(0, 128, layout=gl.SliceLayout(0, QL))
    q8_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, 128], gl.float8e4nv)
    q_s = gl.allocate_shared_memory(gl.float8e4nv, [8, H, 128], q8_sl)
    for t in gl.static_range(4):
        x = gl.load(q_base + 128 * t + jj[None, :]).to(gl.float32) * q_scale[:, None]
        hi = x.to(gl.float8e4nv)
        q_s.index(2 * t).store(hi)
        q_s.index(2 * t + 1).store((x - hi.to(gl.float32)).to(gl.float8e4nv))
    cr = gl.arange(0, 64, layout=gl.SliceLayout(0, QL))
    qr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, 64], gl.bfloat16)
    qr_s = gl.allocate_shared_memory(gl.bfloat16, [H, 64], qr_sl)
    qr_s.store(gl.load(q_base + 512 + cr[None, :]))

    stages, bars_all = staging(NUM_BUF)
    codes3_s, scale_s, rope_s = stages
    c8_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], gl.float8e4nv)
    codes8_s = codes3_s._reinterpret(gl.float8e4nv, [NUM_BUF * 4, 64, 128], c8_sl)
    c16_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.int16)
    codes16_s = codes3_s._reinterpret(gl.int16, [NUM_BUF * 4, 64, 64], c16_sl)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, 64], gl.float16)
    p0_s = gl.allocate_shared_memory(gl.float16, [H, 64], p_sl)
    p1_s = gl.allocate_shared_memory(gl.float16, [H, 64], p_sl)
    p2_s = gl.allocate_shared_memory(gl.float16, [H, 64], p_sl)
    p3_s = gl.allocate_shared_memory(gl.float16, [H, 64], p_sl)
    red_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    red_m = gl.allocate_shared_memory(gl.float32, [4, H], red_sl)
    red_t = gl.allocate_shared_memory(gl.float32, [4, 4], red_sl)
    fence_async_shared()
    gl.thread_barrier()
    descs = (codes_desc, scale_desc, rope_desc)
    pages = table_ptr + b.to(gl.int64) * stride_tb
    page_next = first_copies(descs, stages, bars_all, pages, t_lo, n_tiles, NUM_BUF)

    SC_L: gl.constexpr = scale_layout(8)
    RED_S: gl.constexpr = rows_by_heads(H, 2, 8)
    RED_O: gl.constexpr = rows_by_heads(H, 1, 8)
    TOP_L: gl.constexpr = tops_layout(8)
    key = gl.arange(0, 64, layout=KEYS)
    o0 = gl.zeros([128, H], gl.float32, O_L)
    o1 = gl.zeros([128, H], gl.float32, O_L)
    o2 = gl.zeros([128, H], gl.float32, O_L)
    o3 = gl.zeros([128, H], gl.float32, O_L)
    top0 = 0.0
    top1 = 0.0
    top2 = 0.0
    top3 = 0.0
    m_s = gl.full([H], -float("inf"), gl.float32, HEADS)  # the running references, as S and
    m_o = gl.full([H], -float("inf"), gl.float32, HEADS_O)  # as O hold the heads
    l_p = gl.zeros([64, H], gl.float32, S_L)
    for i in range(n_tiles):
        stage = i % NUM_BUF
        gl.thread_barrier()
        wait_page(bars_all, stage, (i // NUM_BUF) & 1)
        c0 = 4 * stage
        n_valid = seqlen - (t_lo + i) * PAGE
        valid = key < n_valid
        sc, sc0, sc1, sc2, sc3 = page_scales(scale_s.index(stage), n_valid, SC_L, KEYS)
        zero = gl.zeros([64, H], gl.float32, S_L)
        zero8 = gl.zeros([64, H], gl.float32, S8_L)
        s = warpgroup_mma(rope_s.index(stage), qr_s.permute((1, 0)), zero, is_async=True)
        p0, p1, p2, p3 = s_fp8_mmas(codes8_s, c0, q_s, zero8)
        page_next = issue_next(i, n_tiles, NUM_BUF, descs, stages, bars_all, pages, t_lo,
                               page_next)  # fmt: skip
        s, p0, p1, p2, p3 = warpgroup_mma_wait(0, deps=[s, p0, p1, p2, p3])
        lat = gl.convert_layout(p0, S_L) * sc0[:, None] + gl.convert_layout(p1, S_L) * sc1[:, None]
        lat += gl.convert_layout(p2, S_L) * sc2[:, None] + gl.convert_layout(p3, S_L) * sc3[:, None]
        z = (lat * q_unscale[None, :] + s) * scale_log2
        z = gl.where(valid[:, None], z, -float("inf"))
        red_m.store(gl.max(gl.reshape(z, [4, 16, H]), axis=1))
        red_t.store(gl.max(gl.reshape(sc, [4, 16, 4]), axis=1))
        gl.thread_barrier()
        mt_s = gl.convert_layout(gl.max(red_m.load(RED_S), axis=0), HEADS)
        mt_o = gl.convert_layout(gl.max(red_m.load(RED_O), axis=0), HEADS_O)
        tts = page_tops(red_t, TOP_L, SC_L)
        mn_s = gl.where((mt_s > m_s + 8.0) | (mt_s != mt_s), mt_s, m_s)
        mn_o = gl.where((mt_o > m_o + 8.0) | (mt_o != mt_o), mt_o, m_o)
        new0, new1, new2, new3 = lazy_tops(tts, (top0, top1, top2, top3))
        p = gl.exp2(z - mn_s[None, :])
        moved = gl.max((mn_o != m_o).to(gl.int32), axis=0)
        moved = moved | (new0 != top0) | (new1 != top1) | (new2 != top2) | (new3 != top3)
        if moved:
            alpha = gl.exp2(m_o - mn_o)
            o0 = o0 * (alpha * (top0 / new0))[None, :]
            o1 = o1 * (alpha * (top1 / new1))[None, :]
            o2 = o2 * (alpha * (top2 / new2))[None, :]
            o3 = o3 * (alpha * (top3 / new3))[None, :]
            l_p = l_p * gl.exp2(m_s - mn_s)[None, :]
        l_p = l_p + p
        m_s = mn_s
        m_o = mn_o
        store_p(p, (sc0, sc1, sc2, sc3), (new0, new1, new2, new3), (p0_s, p1_s, p2_s, p3_s))
        fence_async_shared()
        gl.thread_barrier()
        o0 = warpgroup_mma(v_operand_2wg(codes16_s.index(c0 + 0), A_V), p0_s.permute((1, 0)), o0)
        o1 = warpgroup_mma(v_operand_2wg(codes16_s.index(c0 + 1), A_V), p1_s.permute((1, 0)), o1)
        o2 = warpgroup_mma(v_operand_2wg(codes16_s.index(c0 + 2), A_V), p2_s.permute((1, 0)), o2)
        o3 = warpgroup_mma(v_operand_2wg(codes16_s.index(c0 + 3), A_V), p3_s.permute((1, 0)), o3)
        top0 = new0
        top1 = new1
        top2 = new2
        top3 = new3

    l_i = gl.sum(l_p, axis=0)
    lse2 = gl.where(l_i > 0.0, m_s + gl.log2(l_i), -float("inf"))
    l_o = gl.convert_layout(l_i, HEADS_O)
    inv_l = gl.where(l_o > 0.0, 1.0 / l_o, 0.0)
    heads_o = gl.arange(0, H, layout=HEADS_O)
    mo = gl.arange(0, 128, layout=gl.SliceLayout(1, O_L))
    # row 16w + 8h + g -> channel 16w + 2g + h of the scale tile
    chan = 16 * (mo >> 4) + 2 * (mo & 7) + ((mo >> 3) & 1)
    base = o_part_ptr + (b * SPLITS + split).to(gl.int64) * 512 * H + heads_o[None, :]
    gl.store(base + chan[:, None] * H, o0 * (top0 * inv_l)[None, :])
    gl.store(base + (128 + chan[:, None]) * H, o1 * (top1 * inv_l)[None, :])
    gl.store(base + (256 + chan[:, None]) * H, o2 * (top2 * inv_l)[None, :])
    gl.store(base + (384 + chan[:, None]) * H, o3 * (top3 * inv_l)[None, :])
    heads = gl.arange(0, H, layout=HEADS)
    gl.store(lse_part_ptr + (b * SPLITS + split) * H + heads, lse2)


@triton.jit
def combine_kernel(o_part_ptr, lse_part_ptr, out_ptr, lse_ptr, H: tl.constexpr,
                   SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
                   D_BLOCK: tl.constexpr):  # fmt: skip
    """One program a (sequence, block of D_BLOCK channels) over every head: the splits'
    partial out [split, channel, head] weighted by their lse (a sequence of no keys: 0)."""
    b = tl.program_id(0)
    d0 = tl.program_id(1) * D_BLOCK
    sp = tl.arange(0, SPLITS_P2)
    live = sp < SPLITS
    h = tl.arange(0, H)
    lse = tl.load(lse_part_ptr + (b * SPLITS + sp[:, None]) * H + h[None, :], mask=live[:, None],
                  other=-float("inf"))  # fmt: skip
    top = tl.max(lse, axis=0)
    w = tl.where(lse == -float("inf"), 0.0, tl.exp2(lse - top[None, :]))
    total = tl.sum(w, axis=0)
    d = d0 + tl.arange(0, D_BLOCK)
    offs = ((b * SPLITS + sp[:, None, None]) * 512 + d[None, :, None]) * H + h[None, None, :]
    o = tl.load(o_part_ptr + offs, mask=live[:, None, None], other=0.0)  # [splits, D_BLOCK, H]
    share = tl.where(total > 0.0, w / total[None, :], 0.0)
    out = tl.sum(o * share[:, None, :], axis=0)  # [D_BLOCK, H]
    tl.store(out_ptr + (b * H + h[None, :]) * 512 + d[:, None], out.to(tl.bfloat16))
    if d0 == 0:
        tl.store(lse_ptr + b * H + h, (top + tl.log2(total)) / 1.4426950408889634)


def descriptors(cache: torch.Tensor):
    rows = cache.reshape(-1, ROW_BYTES)
    n = rows.shape[0]
    codes = rows.view(torch.float8_e4m3fn)
    floats = rows.view(torch.float32)
    halves = rows.view(torch.bfloat16)

    def desc(t, width, box, dtype):
        layout = gl.NVMMASharedLayout.get_default_for(box, dtype)
        return TensorDescriptor(t, [n, width], [width, 1], box, layout)

    c3 = codes[:, :512].unflatten(1, (4, 128)).permute(1, 0, 2)  # [4, rows, 128]
    c3_layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=3)
    return (
        TensorDescriptor(c3, list(c3.shape), list(c3.stride()), [4, 64, 128], c3_layout),
        desc(floats, ROW_BYTES // 4, [64, 4], gl.float32),
        desc(halves, ROW_BYTES // 2, [64, 64], gl.bfloat16),
    )


def decode(q, cache, table, seqlens, splits, descs=None, num_buf=3, asyn=True, s_fp8=False,
           lazy=False, wgs=1):  # fmt: skip
    batch, _, heads, _ = q.shape
    descs = descs or descriptors(cache)
    o_part = torch.empty(batch * splits * heads * 512, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(batch * splits * heads, device=q.device, dtype=torch.float32)
    if wgs == 2:
        keys_as_rows_2wg_kernel[(batch, splits)](
            q, table, seqlens, o_part, lse_part, q.stride(0), table.stride(0),
            576**-0.5 * 1.4426950408889634, *descs, H=heads, SPLITS=splits, NUM_BUF=num_buf,
            num_warps=8,
        )  # fmt: skip
    else:
        keys_as_rows_kernel[(batch, splits)](
            q, table, seqlens, o_part, lse_part, q.stride(0), table.stride(0),
            576**-0.5 * 1.4426950408889634, *descs, H=heads, SPLITS=splits, NUM_BUF=num_buf,
            ASYNC=asyn, S_FP8=s_fp8, LAZY=lazy, num_warps=4,
        )  # fmt: skip
    out = torch.empty(batch, 1, heads, 512, device=q.device, dtype=torch.bfloat16)
    lse = torch.empty(batch, heads, 1, device=q.device, dtype=torch.float32)
    combine_kernel[(batch, 512 // 64)](o_part, lse_part, out, lse, H=heads, SPLITS=splits,
                                       SPLITS_P2=triton.next_power_of_2(splits),
                                       D_BLOCK=64)  # fmt: skip
    return out, lse


def main() -> None:
    from kvgen.bench import decode as bd
    from kvgen.bench import harness
    from kvgen.formats.mla_decode import mla_decode
    from kvgen.ops import get_mla_metadata

    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="16,32")
    ap.add_argument("--splits", default="2")
    ap.add_argument("--bufs", default="2")
    ap.add_argument("--async", dest="asyn", default="0,1", help="1: pipelined MMAs, 0: each waited")
    ap.add_argument("--s-fp8", default="0,1", help="1: S by e4m3 MMAs (codes x q's two e4m3 parts)")
    ap.add_argument("--lazy", default="0,1", help="1: O rescaled only when a reference moves far")
    ap.add_argument("--wgs", default="1,2", help="2: the 8-warp kernel (e4m3 S, lazy; its own)")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    copy_bw = harness.copy_bandwidth(dev)
    print(f"copy {copy_bw / 1e9:.0f} GB/s", flush=True)
    results = []
    lengths = [bd.SEQLEN] * bd.BATCH
    for h in [int(x) for x in args.heads.split(",")]:
        q, k, table, sl = bd._make(lengths, h, dev)
        k_scale = torch.tensor([1.0], device=dev)
        cache = bd.quantized_caches(k, k_scale, ("fp8_ds_mla",))["fp8_ds_mla"]
        deq = bd.dequantized("fp8_ds_mla", cache, k_scale)
        sub = slice(0, 3)
        ref, ref_lse = mla_decode(q[sub].cpu(), deq.cpu(), table[sub].cpu(), sl[sub].cpu(), 512)
        meta, nsp = get_mla_metadata(sl, h, 1)
        args_ = (q, table, sl, meta, nsp)
        callers = {}
        for label, call in bd._callers(dev, k):
            if label == "auto":
                callers["bf16 (kvgen)"] = functools.partial(call, *args_)
        for label, call in bd._callers(dev, cache, "fp8_ds_mla"):
            if label.startswith("auto"):
                callers["fp8_ds_mla (kvgen op)"] = functools.partial(call, *args_)
        descs = descriptors(cache)
        configs = [
            (s, int(nb), int(a), int(f8), int(lz), int(wg))
            for s in [int(x) for x in args.splits.split(",")]
            for nb in args.bufs.split(",")
            for a in args.asyn.split(",")
            for f8 in args.s_fp8.split(",")
            for lz in args.lazy.split(",")
            for wg in args.wgs.split(",")
            if wg == "1" or (a, f8, lz) == ("0", "1", "1")
        ]
        for splits, nb, a, f8, lz, wg in configs:
            name = f"keys-as-rows splits={splits} bufs={nb} async={a} s_fp8={f8} lazy={lz}"
            name += " 8 warps" if wg == 2 else ""
            call = functools.partial(decode, q, cache, table, sl, splits, descs,
                                     nb, bool(a), bool(f8), bool(lz), wg)  # fmt: skip
            try:
                call()
                torch.cuda.synchronize()
                callers[name] = call
            except Exception as exc:  # (a config that does not compile or fit: reported)
                print(f"h={h} {name}: {type(exc).__name__}: {str(exc)[-600:]}", flush=True)
        times = {n: [] for n in callers}
        for _ in range(3):
            for n, call in callers.items():
                times[n].append(harness.graph_time_us(lambda i, call=call: call(), 1, calls=8,
                                                      replays=5))  # fmt: skip
        bf16_t = statistics.median(times["bf16 (kvgen)"])
        for n, call in callers.items():
            out, lse = call()
            torch.cuda.synchronize()
            got = out[sub].float().cpu().double()
            err = float((got - ref).norm() / ref.norm())
            lse_err = float((lse[sub].cpu().double().reshape(-1) - ref_lse.reshape(-1)).abs().max())
            t = statistics.median(times[n])
            nbytes = 656 if "bf16" not in n else 1152
            bw = sum(lengths) * nbytes / (t * 1e-6)
            row = dict(heads=h, kernel=n, us=t, vs_bf16=t / bf16_t, bytes_per_token=nbytes,
                       gbps=bw / 1e9, of_copy=bw / copy_bw, rel_err_out=err,
                       max_err_lse=lse_err)  # fmt: skip
            results.append(row)
            print(f"h={h:3d} {n:34s} {t:8.1f} us  x{t / bf16_t:.2f} of bf16  "
                  f"{bw / 1e9:6.0f} GB/s ({bw / copy_bw:.2f} of copy)  "
                  f"out err {err:.1e}  lse err {lse_err:.1e}", flush=True)  # fmt: skip
        del q, k, table, sl, cache, deq
        torch.cuda.empty_cache()
    if args.json:
        env = harness.environment()
        with open(args.json, "w") as f:
            json.dump({"env": env, "copy_gbps": copy_bw / 1e9, "rows": results}, f, indent=2)


if __name__ == "__main__":
    main()
