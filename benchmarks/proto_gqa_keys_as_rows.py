"""Experiment: the paged GQA decode over int8 and fp8 e4m3 per-token-head caches with the keys as
the MMA's rows (sm90, Gluon): integer MMAs for int8, e4m3 MMAs for fp8.

kvgen's GQA decode (gqa_decode.py.j2) pads a KV head's query rows (the group, 4 at 32 / 8
heads) to the MMA's 16 and converts every K and V code to fp16 (about 44 warp instructions a
key and KV head against bf16's 29). Here, per KV head and 64-key tile (4 pages of 16):

    S^T [64 keys, N] = K [64 keys, 128] . Q^T        (s8 x s8 -> s32, K straight from shared memory)
    O^T [128, N]    += V^T [128, 64 keys] . P'^T     (V^T's codes moved into the A registers)

N is the group padded to 8 (the MMA's least). q is scaled per head by a power of two to below
2^13 and split into two int8 parts, q = 128 hi + lo (14 bits a value: exact for every bf16
value within 2^5 of its head's largest, within 2^-14 of the largest below that), so S is
exact in int32 and takes no conversion: S = (128 S_hi + S_lo) * k_scale[key] * 2^e. The
softmax weights times each key's V scale, P' = p * v_scale[key], go to 14-bit integers the
same way against a bound of their largest in the page (per head), two int8 parts, and each
page's integer product is added to O in fp32. V^T's A operand is V's codes, bytes moved
between registers (no conversion). K and V come by cp.async, 16 bytes a thread, through a
ring of NUM_BUF stages; the scales by plain loads. The fp8 e4m3 cache (FP8) takes the same
path with e4m3 MMAs and fp32 accumulators: q in two e4m3 parts (below 2^8 after the per-head
scale; exact for bf16 values within 2^10 of the head's largest) and P' in two e4m3 parts
(below 2^8 against its bound), each pair of MMAs into one accumulator. On the H200 the fp8
path's scores are wrong: its low parts are formed from the high parts' codes converted back
(docs/performance.md). The package's rows variant (templates/gqa_decode_rows.py.j2) is this
kernel's int8 path, and an e4m3 form without that conversion.

One program a (sequence, KV head, split) with 4 warps; block size 16; s_q 1; head 128.

    python benchmarks/proto_gqa_keys_as_rows.py [--heads 32,64] [--kv int8,fp8e4m3]
        [--splits 1,2] [--bufs 3] [--json F]

It times the kernel beside kvgen's GQA decode over the bf16 cache and over each quantized one
(the op, tuned configs), in one process, and checks each against the float64 reference over its
dequantized cache (the bf16 row against the first format's: its error is the quantization's).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

PAGE = gl.constexpr(16)  # keys a block
TILE = gl.constexpr(64)  # keys a tile (the MMA's M)
D = gl.constexpr(128)

# A [64 keys, 128 bytes] tile as 16-byte pieces, 4 a thread
CHUNKS = gl.constexpr(gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0]))
# V's bytes as the V^T MMA's A operand wants them: thread (w, 4g + c) holds the word of channels
# 4(8w + g) .. + 3 of keys 4c + e and 16 + 4c + e (e = 0..3) of each 32-key half
V_BYTES = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [16, 0], [32, 0]],
        lane_bases=[[4, 0], [8, 0], [0, 4], [0, 8], [0, 16]],
        warp_bases=[[0, 32], [0, 64]],
        block_bases=[],
        shape=[64, 128],
    )
)


@gluon.constexpr_function
def acc_layout(n):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, n, 32])  # fmt: skip


@gluon.jit
def split_14(x):
    """fp32 ``x`` (|x| < 2^13, integral) as int8 (hi, lo): x = 128 hi + lo, |hi| <= 64, lo in
    [-64, 63]."""
    xi = x.to(gl.int32)
    hi = (xi + 64) >> 7
    return hi.to(gl.int8), (xi - hi * 128).to(gl.int8)


@gluon.jit
def rint(x):
    """Round to the nearest integer, half to even (|x| < 2^22)."""
    return (x + 12582912.0) - 12582912.0


@gluon.jit
def issue_tile(k_s, v_s, k_ptr, v_ptr, pages, t, seqlen, kv_off, stride_blk, stride_slot):
    """cp.async of tile t's K and V bytes of this KV head (keys past the length: zeros)."""
    key = gl.arange(0, TILE, layout=gl.SliceLayout(1, CHUNKS))
    byte = gl.arange(0, D, layout=gl.SliceLayout(0, CHUNKS))
    pos = t * TILE + key
    live = pos < seqlen
    page = gl.load(pages + pos // PAGE, mask=live, other=0)
    row = page.to(gl.int64) * stride_blk + (pos % PAGE) * stride_slot + kv_off
    row = gl.multiple_of(row, 16)  # (the strides and the head's offset are multiples of 128)
    offs = gl.max_contiguous(gl.multiple_of(row[:, None] + byte[None, :], [1, 16]), [1, 16])
    async_copy.async_copy_global_to_shared(k_s, k_ptr + offs, mask=live[:, None])
    async_copy.async_copy_global_to_shared(v_s, v_ptr + offs, mask=live[:, None])


@gluon.jit
def gqa_rows_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, seqlens_ptr, o_part_ptr,
                    lse_part_ptr, stride_qb, stride_qh, stride_blk, stride_slot, stride_sblk,
                    stride_sslot, stride_tb, scale_log2, G: gl.constexpr, N: gl.constexpr,
                    SPLITS: gl.constexpr, NUM_BUF: gl.constexpr, FP8: gl.constexpr):  # fmt: skip
    b = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)
    h_kv = gl.num_programs(1)
    seqlen = gl.load(seqlens_ptr + b)
    tiles = (seqlen + TILE - 1) // TILE
    per = (tiles + SPLITS - 1) // SPLITS
    t_lo = split * per
    n_tiles = gl.maximum(gl.minimum(t_lo + per, tiles) - t_lo, 0)

    S_L: gl.constexpr = acc_layout(N)  # [64 keys, N] and O^T [128, N]
    KEYS: gl.constexpr = gl.SliceLayout(1, S_L)
    HEADS: gl.constexpr = gl.SliceLayout(0, S_L)
    A_V: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S_L, k_width=4)

    # --- q of this KV head's group: 2^-e q below 2^13 per head, two int8 parts
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    hq = gl.arange(0, N, layout=gl.SliceLayout(1, QL))
    ch = gl.arange(0, D, layout=gl.SliceLayout(0, QL))
    q_rows = q_ptr + b.to(gl.int64) * stride_qb + (kvh * G + hq[:, None]) * stride_qh
    q = gl.load(q_rows + ch[None, :], mask=(hq < G)[:, None], other=0.0).to(gl.float32)
    top = gl.max(gl.abs(q), axis=1)
    # int8: top < 2^(expo + 13) (two int8 parts); fp8: top < 2^(expo + 8) (two e4m3 parts)
    expo = ((top.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127 + 1 - (8 if FP8 else 13)
    expo = gl.minimum(gl.maximum(expo, -100), 100)
    q_scale = ((127 - expo) << 23).to(gl.float32, bitcast=True)
    q_unscale = gl.convert_layout(((127 + expo) << 23).to(gl.float32, bitcast=True), HEADS)
    CODE: gl.constexpr = gl.float8e4nv if FP8 else gl.int8
    if FP8:
        xq = q * q_scale[:, None]
        q_hi = xq.to(gl.float8e4nv)
        q_lo = (xq - q_hi.to(gl.float32)).to(gl.float8e4nv)
    else:
        q_hi, q_lo = split_14(rint(q * q_scale[:, None]))
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, 128], CODE)
    qh_s = gl.allocate_shared_memory(CODE, [N, 128], q_sl)
    ql_s = gl.allocate_shared_memory(CODE, [N, 128], q_sl)
    qh_s.store(q_hi)
    ql_s.store(q_lo)

    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], CODE)
    k_s = gl.allocate_shared_memory(CODE, [NUM_BUF, 64, 128], kv_sl)
    v_s = gl.allocate_shared_memory(CODE, [NUM_BUF, 64, 128], kv_sl)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, 64], CODE)
    ph_s = gl.allocate_shared_memory(CODE, [N, 64], p_sl)
    pl_s = gl.allocate_shared_memory(CODE, [N, 64], p_sl)
    red_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    red_m = gl.allocate_shared_memory(gl.float32, [4, N], red_sl)
    red_v = gl.allocate_shared_memory(gl.float32, [4, N], red_sl)
    RED_L: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [1, 0], [2, 0]] + ([[0, 8]] if N == 16 else []),
        lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
        warp_bases=[[0, 0], [0, 0]],
        block_bases=[],
        shape=[4, N],
    )
    fence_async_shared()
    gl.thread_barrier()

    pages = table_ptr + b.to(gl.int64) * stride_tb
    kv_off = kvh * 128
    for j in gl.static_range(NUM_BUF - 1):
        if j < n_tiles:
            issue_tile(k_s.index(j), v_s.index(j), k_ptr, v_ptr, pages, t_lo + j, seqlen, kv_off,
                       stride_blk, stride_slot)  # fmt: skip
        async_copy.commit_group()

    key = gl.arange(0, TILE, layout=KEYS)
    o = gl.zeros([128, N], gl.float32, S_L)
    m_i = gl.full([N], -float("inf"), gl.float32, HEADS)
    l_p = gl.zeros([64, N], gl.float32, S_L)
    ACC: gl.constexpr = gl.float32 if FP8 else gl.int32
    zero = gl.zeros([64, N], ACC, S_L)
    zero_o = gl.zeros([128, N], ACC, S_L)
    for i in range(n_tiles):
        stage = i % NUM_BUF
        t = t_lo + i
        # this tile's scales (plain loads; their latency overlaps the copy's wait)
        pos = t * TILE + key
        valid = pos < seqlen
        page = gl.load(pages + pos // PAGE, mask=valid, other=0).to(gl.int64)
        srow = page * stride_sblk + (pos % PAGE) * stride_sslot + kvh
        k_sc = gl.load(ks_ptr + srow, mask=valid, other=0.0)
        v_sc = gl.load(vs_ptr + srow, mask=valid, other=0.0)
        async_copy.wait_group(NUM_BUF - 2)  # this thread's pieces of tile i are in
        fence_async_shared()
        gl.thread_barrier()  # everyone's pieces are in; everyone is done with tile i - 1
        nxt = i + NUM_BUF - 1
        if nxt < n_tiles:
            ns = nxt % NUM_BUF
            issue_tile(k_s.index(ns), v_s.index(ns), k_ptr, v_ptr, pages, t_lo + nxt, seqlen,
                       kv_off, stride_blk, stride_slot)  # fmt: skip
        async_copy.commit_group()
        kt = k_s.index(stage)
        if FP8:  # q = hi + lo into one accumulator
            s = warpgroup_mma(kt, qh_s.permute((1, 0)), zero, is_async=True)
            s = warpgroup_mma(kt, ql_s.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(0, deps=[s])
        else:  # exact in int32: 128 S_hi + S_lo
            s_hi = warpgroup_mma(kt, qh_s.permute((1, 0)), zero, is_async=True)
            s_lo = warpgroup_mma(kt, ql_s.permute((1, 0)), zero, is_async=True)
            s_hi, s_lo = warpgroup_mma_wait(0, deps=[s_hi, s_lo])
            s = (s_hi * 128 + s_lo).to(gl.float32)
        z = s * (k_sc * scale_log2)[:, None] * q_unscale[None, :]
        z = gl.where(valid[:, None], z, -float("inf"))
        red_m.store(gl.max(gl.reshape(z, [4, 16, N]), axis=1))
        vz = gl.where(valid, v_sc, 0.0)[:, None] + gl.zeros([64, N], gl.float32, S_L)
        red_v.store(gl.max(gl.reshape(vz, [4, 16, N]), axis=1))
        gl.thread_barrier()
        m_tile = gl.convert_layout(gl.max(red_m.load(RED_L), axis=0), HEADS)
        v_top = gl.max(gl.max(red_v.load(RED_L), axis=0), axis=0)  # the page's largest V scale
        m_new = gl.where((m_tile > m_i + 8.0) | (m_tile != m_tile), m_tile, m_i)
        p = gl.exp2(z - m_new[None, :])
        moved = gl.max((m_new != m_i).to(gl.int32), axis=0)
        if moved:
            alpha = gl.exp2(m_i - m_new)
            o = o * alpha[None, :]
            l_p = l_p * alpha[None, :]
        l_p = l_p + p
        m_i = m_new
        # P' = p * v_scale against a bound of its page's largest per head: exp2(m_tile - m_new)
        # times the page's largest V scale (>= every p * v_scale of the head in the page)
        bound = gl.exp2(gl.minimum(m_tile - m_new, 8.0)) * v_top
        # P' = unit * x: x < 2^13 in 14-bit integers (int8), x < 2^8 in two e4m3 parts (fp8)
        unit = gl.where(bound > 0.0, bound * (1.0 / (256.0 if FP8 else 8000.0)), 1.0)
        if FP8:
            x = p * v_sc[:, None] / unit[None, :]
            p_hi = x.to(gl.float8e4nv)
            p_lo = (x - p_hi.to(gl.float32)).to(gl.float8e4nv)
        else:
            p_hi, p_lo = split_14(rint(p * v_sc[:, None] / unit[None, :]))
        ph_s.store(p_hi.permute((1, 0)))
        pl_s.store(p_lo.permute((1, 0)))
        fence_async_shared()
        gl.thread_barrier()
        w = v_s.index(stage).load(V_BYTES)
        vt = w.permute((1, 0)).reshape([4, 8, 2, 2, 64]).permute((2, 0, 3, 1, 4)).reshape([128, 64])
        vt = gl.convert_layout(vt, A_V)
        if FP8:
            o_t = warpgroup_mma(vt, ph_s.permute((1, 0)), zero_o, is_async=True)
            o_t = warpgroup_mma(vt, pl_s.permute((1, 0)), o_t, is_async=True)
            o_t = warpgroup_mma_wait(0, deps=[o_t])
            o += o_t * unit[None, :]
        else:
            o_hi = warpgroup_mma(vt, ph_s.permute((1, 0)), zero_o, is_async=True)
            o_lo = warpgroup_mma(vt, pl_s.permute((1, 0)), zero_o, is_async=True)
            o_hi, o_lo = warpgroup_mma_wait(0, deps=[o_hi, o_lo])
            o += (o_hi * 128 + o_lo).to(gl.float32) * unit[None, :]
    async_copy.wait_group(0)

    # --- partial out (normalised) and lse (log2) of this split: [split, channel, head]
    l_i = gl.sum(l_p, axis=0)
    inv_l = gl.where(l_i > 0.0, 1.0 / l_i, 0.0)
    lse2 = gl.where(l_i > 0.0, m_i + gl.log2(l_i), -float("inf"))
    heads = gl.arange(0, N, layout=HEADS)
    mo = gl.arange(0, 128, layout=gl.SliceLayout(1, S_L))
    # row 64b + 16w + 8h + g -> channel 4(8w + g) + 2b + h
    chan = 4 * (8 * ((mo >> 4) & 3) + (mo & 7)) + 2 * (mo >> 6) + ((mo >> 3) & 1)
    prog = (b * h_kv + kvh) * SPLITS + split
    base = o_part_ptr + prog.to(gl.int64) * 128 * N + heads[None, :]
    gl.store(base + chan[:, None] * N, o * inv_l[None, :])
    gl.store(lse_part_ptr + prog * N + heads, lse2)


@triton.jit
def combine_kernel(o_part_ptr, lse_part_ptr, out_ptr, lse_ptr, G: tl.constexpr, N: tl.constexpr,
                   SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr):  # fmt: skip
    """One program a (sequence, KV head): the splits' partial out [split, channel, head]
    weighted by their lse; out [batch, 1, heads, 128], lse [batch, heads, 1] (natural log)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    h_kv = tl.num_programs(1)
    sp = tl.arange(0, SPLITS_P2)
    live = sp < SPLITS
    h = tl.arange(0, N)
    prog = (b * h_kv + kvh) * SPLITS + sp
    lse = tl.load(lse_part_ptr + prog[:, None] * N + h[None, :], mask=live[:, None],
                  other=-float("inf"))  # fmt: skip
    top = tl.max(lse, axis=0)
    w = tl.where(lse == -float("inf"), 0.0, tl.exp2(lse - top[None, :]))
    total = tl.sum(w, axis=0)
    d = tl.arange(0, 128)
    offs = (prog[:, None, None] * 128 + d[None, :, None]) * N + h[None, None, :]
    o = tl.load(o_part_ptr + offs, mask=live[:, None, None], other=0.0)  # [splits, 128, N]
    share = tl.where(total > 0.0, w / total[None, :], 0.0)
    out = tl.sum(o * share[:, None, :], axis=0)  # [128, N]
    head = kvh * G + h
    ok = h < G
    tl.store(out_ptr + (b * h_kv * G + head[None, :]) * 128 + d[:, None], out.to(tl.bfloat16),
             mask=ok[None, :])  # fmt: skip
    tl.store(lse_ptr + b * h_kv * G + head, (top + tl.log2(total)) * 0.6931471805599453, mask=ok)


def decode(q, k, v, ks, vs, table, seqlens, splits, num_buf=3):
    batch, _, heads, d = q.shape
    if k.dtype not in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"int8 or float8_e4m3fn caches only, not {k.dtype}")
    h_kv = k.shape[2]
    g = heads // h_kv
    n = max(8, triton.next_power_of_2(g))
    progs = batch * h_kv * splits
    o_part = torch.empty(progs * 128 * n, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(progs * n, device=q.device, dtype=torch.float32)
    gqa_rows_kernel[(batch, h_kv, splits)](
        q, k, v, ks, vs, table, seqlens, o_part, lse_part, q.stride(0), q.stride(2), k.stride(0),
        k.stride(1), ks.stride(0), ks.stride(1), table.stride(0), d**-0.5 * 1.4426950408889634,
        G=g, N=n, SPLITS=splits, NUM_BUF=num_buf, FP8=k.dtype == torch.float8_e4m3fn,
        num_warps=4,
    )  # fmt: skip
    out = torch.empty(batch, 1, heads, d, device=q.device, dtype=torch.bfloat16)
    lse = torch.empty(batch, heads, 1, device=q.device, dtype=torch.float32)
    combine_kernel[(batch, h_kv)](o_part, lse_part, out, lse, G=g, N=n, SPLITS=splits,
                                  SPLITS_P2=triton.next_power_of_2(splits))  # fmt: skip
    return out, lse


def main() -> None:
    from kvgen.bench import gqa_decode as bg
    from kvgen.bench import harness
    from kvgen.formats.gqa_decode import dequantize_cache, gqa_decode
    from kvgen.ops import flash_attn_with_kvcache

    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="32,64")
    ap.add_argument("--kv", default="int8,fp8e4m3", help="the quantized caches (int8, fp8e4m3)")
    ap.add_argument("--splits", default="1,2")
    ap.add_argument("--bufs", default="3")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    copy_bw = harness.copy_bandwidth(dev)
    print(f"copy {copy_bw / 1e9:.0f} GB/s", flush=True)
    lengths = [4096] * 128
    formats = args.kv.split(",")
    results = []
    for h in [int(x) for x in args.heads.split(",")]:
        callers = {}  # name -> (format, call)
        refs = {}
        for kv in ["auto", *formats]:
            q, k, v, ks, vs, table, sl = bg.problem(kv, 0, lengths, h, dev)
            label = "bf16" if kv == "auto" else kv

            def op(a=(q, k, v), ks=ks, vs=vs, table=table, sl=sl):
                return flash_attn_with_kvcache(
                    *a, cache_seqlens=sl, block_table=table, return_softmax_lse=True,
                    k_scale_cache=ks, v_scale_cache=vs,
                )  # fmt: skip

            callers[f"{label} (kvgen)"] = (label, op)
            if kv == "auto":
                continue
            # the reference over the pages of the first two sequences only, renumbered
            sub = slice(0, 2)
            used = table[sub].reshape(-1).long()
            small = torch.arange(used.numel(), dtype=torch.int32).reshape(table[sub].shape)
            k_deq = dequantize_cache(k[used].cpu(), ks[used].cpu(), 128)
            v_deq = dequantize_cache(v[used].cpu(), vs[used].cpu(), 128)
            refs[label] = gqa_decode(q[sub].cpu(), k_deq, v_deq, small, sl[sub].cpu())
            for splits in [int(x) for x in args.splits.split(",")]:
                for nb in [int(x) for x in args.bufs.split(",")]:
                    name = f"{label} keys-as-rows splits={splits} bufs={nb}"

                    def call(splits=splits, nb=nb, a=(q, k, v, ks, vs, table, sl)):
                        return decode(*a, splits, nb)

                    try:
                        call()
                        torch.cuda.synchronize()
                        callers[name] = (label, call)
                    except Exception as exc:  # (a config that does not compile or fit)
                        print(f"h={h} {name}: {type(exc).__name__}: {str(exc)[-800:]}", flush=True)
        times = {n: [] for n in callers}
        for _ in range(3):
            for n, (_, call) in callers.items():
                times[n].append(harness.graph_time_us(lambda i, call=call: call(), 1, calls=8,
                                                      replays=5))  # fmt: skip
        bf16_t = statistics.median(times["bf16 (kvgen)"])
        for n, (label, call) in callers.items():
            out, lse = call()
            torch.cuda.synchronize()
            ref, ref_lse = refs[formats[0] if label == "bf16" else label]
            got = out[:2].float().cpu().double()
            err = float((got - ref).norm() / ref.norm())
            lse_err = float((lse[:2].cpu().double().reshape(-1) - ref_lse.reshape(-1)).abs().max())
            t = statistics.median(times[n])
            nbytes = bg.token_bytes("auto" if label == "bf16" else label, 0)
            bw = sum(lengths) * nbytes / (t * 1e-6)
            row = dict(heads=h, kernel=n, us=t, vs_bf16=t / bf16_t, bytes_per_token=nbytes,
                       gbps=bw / 1e9, of_copy=bw / copy_bw, rel_err_out=err,
                       max_err_lse=lse_err)  # fmt: skip
            results.append(row)
            print(f"h={h:3d} {n:44s} {t:8.1f} us  x{t / bf16_t:.2f} of bf16  "
                  f"{bw / 1e9:6.0f} GB/s ({bw / copy_bw:.2f} of copy)  "
                  f"out err {err:.1e}  lse err {lse_err:.1e}", flush=True)  # fmt: skip
        callers.clear()
        torch.cuda.empty_cache()
    if args.json:
        env = harness.environment()
        with open(args.json, "w") as f:
            json.dump({"env": env, "copy_gbps": copy_bw / 1e9, "rows": results}, f, indent=2)


if __name__ == "__main__":
    main()
