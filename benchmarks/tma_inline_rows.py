"""Whether TMA reads a KV head's rows out of vLLM's inline-scale layout, and how fast: the
experiment behind a TMA path for the GQA rows decode's inline rows.

vLLM allocates a cache as ``[num_blocks, 2, block_size, num_kv_heads, head_size + pad]`` bytes
(int8 / fp8 at head 128: 132-byte rows, the fp32 scale in the last 4); a token's rows of the
KV heads lie side by side, so head h's rows start 132 h bytes into the token's 1056, 4 h bytes
past a 32-byte sector. cp.async copies of 4 bytes (the rows' alignment) read each 32 bytes of
a row from two sectors. A TMA descriptor needs its base address and strides 16-byte aligned,
and on sm90 a box's first column must be 16-byte aligned too (a box at column 132 h, h not a
multiple of 4, stops the kernel with an illegal instruction: ``--unaligned`` shows it). So
over the bytes as ``[tokens, 1056]`` (the token stride) head h's box starts at
c = 132 h rounded down to 16 bytes, and its row lies o = 132 h - c (0, 4, 8 or 12) bytes into
the box: a box of ``[16, 128]`` at c and one of ``[16, 16]`` at c + 128 hold a page's 16 rows
of head h (o + 132 <= 144; a shared memory buffer's sizes are powers of two: no single box of
144 bytes a row), the reader taking each row from byte o of its box.

Checks every (page, head) box against torch (the last head's box runs 12 bytes past the token:
TMA fills them with zeros), then times a kernel that reads every box of a cache once through
TMA (a checksum a program, nothing else written) in a CUDA graph, against the copy bandwidth
measured in the same run (``kvgen.bench.harness``, as the bench measures): the rows' own bytes
(132 a row) over the kernel's time.

    python benchmarks/tma_inline_rows.py [--tokens 1048576] [--stages 4] [--unaligned]
"""

from __future__ import annotations

import argparse

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kvgen.bench import harness

HEADS, ROW, PAGE, BOX = 8, 132, 16, 144  # KV heads, bytes a row, rows a page, bytes checked
TOKEN = HEADS * ROW  # 1056 bytes: 33 sectors
LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
TAIL = 16  # the scale box's width (its first 4 bytes the row's scale)


@gluon.jit
def boxes_kernel(desc, tail_desc, out_ptr, PAGE: gl.constexpr, BOX: gl.constexpr,
                 ROW: gl.constexpr, ALIGN: gl.constexpr):  # fmt: skip
    """Boxes (page, head) to out[page, head]: the 128 bytes of its 16 rows from column 132 head
    rounded down to ALIGN bytes, and the next 16."""
    page = gl.program_id(0)
    head = gl.program_id(1)
    heads = gl.num_programs(1)
    smem = gl.allocate_shared_memory(gl.uint8, [PAGE, 128], desc.layout)
    tail_s = gl.allocate_shared_memory(gl.uint8, [PAGE, 16], tail_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, PAGE * (128 + 16))
    col = head * ROW // ALIGN * ALIGN
    tma.async_copy_global_to_shared(desc, [page * PAGE, col], bar, smem)
    tma.async_copy_global_to_shared(tail_desc, [page * PAGE, col + 128], bar, tail_s)
    mbarrier.wait(bar, 0)
    mbarrier.invalidate(bar)
    L: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [4, 1], [1, 0])
    T: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    data = smem.load(L)
    tail = tail_s.load(T)
    base = out_ptr + (page * heads + head) * PAGE * BOX
    r = gl.arange(0, PAGE, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, L))
    gl.store(base + r[:, None] * BOX + c[None, :], data)
    r = gl.arange(0, PAGE, layout=gl.SliceLayout(1, T))
    c = gl.arange(0, 16, layout=gl.SliceLayout(0, T))
    gl.store(base + r[:, None] * BOX + 128 + c[None, :], tail)


@gluon.jit
def issue(desc, tail_desc, smem, tail_s, bars, s, page, head, PAGE: gl.constexpr,
          ROW: gl.constexpr):  # fmt: skip
    """TMA of page ``page``'s rows of ``head`` (the 128 bytes from the row's column rounded
    down to 16, and the 16 after them) into stage s."""
    mbarrier.expect(bars.index(s), PAGE * (128 + 16))
    col = head * ROW // 16 * 16
    tma.async_copy_global_to_shared(desc, [page * PAGE, col], bars.index(s), smem.index(s))
    tma.async_copy_global_to_shared(tail_desc, [page * PAGE, col + 128], bars.index(s),
                                    tail_s.index(s))  # fmt: skip


@gluon.jit
def read_kernel(desc, tail_desc, sums_ptr, pages, PAGE: gl.constexpr, ROW: gl.constexpr,
                STAGES: gl.constexpr):  # fmt: skip
    """Head program_id(1)'s boxes (rows and scales) of pages program_id(0), + grid0, ...,
    STAGES pages in flight; the sum of the rows' 132 bytes (from byte o of the boxes: the row's
    128 bytes and its scale's 4) to sums, every byte of the boxes read into registers."""
    head = gl.program_id(1)
    smem = gl.allocate_shared_memory(gl.uint8, [STAGES, PAGE, 128], desc.layout)
    tail_s = gl.allocate_shared_memory(gl.uint8, [STAGES, PAGE, 16], tail_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(bars.index(j), count=1)
    first = gl.program_id(0)
    step = gl.num_programs(0)
    n = (pages - first + step - 1) // step
    for j in gl.static_range(STAGES):
        if j < n:
            issue(desc, tail_desc, smem, tail_s, bars, j, first + j * step, head, PAGE, ROW)
    L: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [4, 1], [1, 0])
    acc = gl.zeros([PAGE, 128], gl.int32, L)
    T: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    sc = gl.zeros([PAGE, 16], gl.int32, T)
    o = head * ROW % 16  # where the row starts in its box
    keep = gl.arange(0, 128, layout=gl.SliceLayout(0, L)) >= o
    keep_tail = gl.arange(0, 16, layout=gl.SliceLayout(0, T)) < o + 4
    for i in range(n):
        s = i % STAGES
        mbarrier.wait(bars.index(s), (i // STAGES) & 1)
        acc += smem.index(s).load(L).to(gl.int32)
        sc += tail_s.index(s).load(T).to(gl.int32)
        gl.thread_barrier()  # every warp's reads of the stage done before it is refilled
        if i + STAGES < n:
            p = first + (i + STAGES) * step
            issue(desc, tail_desc, smem, tail_s, bars, s, p, head, PAGE, ROW)
    rows = gl.sum(gl.sum(gl.where(keep[None, :], acc, 0), axis=1), axis=0)
    tails = gl.sum(gl.sum(gl.where(keep_tail[None, :], sc, 0), axis=1), axis=0)
    total = rows + tails
    gl.store(sums_ptr + first * gl.num_programs(1) + head, total)


def descriptors(cache: torch.Tensor) -> tuple[TensorDescriptor, TensorDescriptor]:
    """``cache`` ([tokens, 1056] bytes, contiguous) in boxes of [16, 128] (rows) and [16, 16]
    (their scales)."""
    shape, strides = list(cache.shape), list(cache.stride())
    return (TensorDescriptor(cache, shape, strides, [PAGE, 128], LAYOUT),
            TensorDescriptor(cache, shape, strides, [PAGE, TAIL], LAYOUT))  # fmt: skip


def check(device, align: int = 16) -> None:
    """Every (page, head) box, its first column 132 h rounded down to ``align`` bytes, against
    the cache's bytes there."""
    pages = 6
    cache = torch.randint(0, 256, (pages * PAGE, TOKEN), dtype=torch.uint8, device=device)
    out = torch.full((pages, HEADS, PAGE, BOX), 0xAB, dtype=torch.uint8, device=device)
    boxes_kernel[(pages, HEADS)](*descriptors(cache), out, PAGE, BOX, ROW, align, num_warps=4)
    torch.cuda.synchronize()
    padded = torch.zeros(pages * PAGE, TOKEN + BOX, dtype=torch.uint8, device=device)
    padded[:, :TOKEN] = cache  # (TMA reads zeros past the tensor's last column)
    for h in range(HEADS):
        col = h * ROW // align * align
        want = padded[:, col : col + BOX].reshape(pages, PAGE, BOX)
        if not torch.equal(out[:, h], want):
            bad = (out[:, h] != want).nonzero()[:4].tolist()
            raise SystemExit(f"FAIL head {h}: box differs from the cache at {bad}")
        row = want[..., h * ROW - col :][..., :ROW]  # the row's own 132 bytes, from byte o
        assert torch.equal(row, cache[:, h * ROW : (h + 1) * ROW].reshape(pages, PAGE, ROW))
    print(f"ok   every [16, 128] + [16, 16] box at column 132 h rounded down to {align} bytes "
          f"(+ 128) equals the cache's bytes and holds the row ({pages} pages; the last head's "
          f"bytes past the token read as 0)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1 << 20, help="tokens of the cache (K alone)")
    ap.add_argument("--stages", type=int, default=4, help="boxes in flight a program")
    ap.add_argument("--programs", type=int, default=0, help="programs a head (0: 4 an SM / 8)")
    ap.add_argument("--unaligned", action="store_true",
                    help="only the check, with boxes at the rows' own columns (132 h): on sm90 "
                    "a CUDA error where 132 h is not a multiple of 16")  # fmt: skip
    args = ap.parse_args()
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    if args.unaligned:
        check(device, align=1)
        return
    check(device)
    pages = args.tokens // PAGE
    cache = torch.randint(0, 256, (pages * PAGE, TOKEN), dtype=torch.uint8, device=device)
    descs = descriptors(cache)
    per_head = args.programs or max(1, 4 * props.multi_processor_count // HEADS)
    sums = torch.empty(per_head * HEADS, dtype=torch.int32, device=device)
    grid = (per_head, HEADS)
    us = harness.graph_time_us(
        lambda i: read_kernel[grid](*descs, sums, pages, PAGE, ROW, args.stages, num_warps=4), 1
    )
    useful = pages * PAGE * TOKEN  # every row's own 132 bytes, each once
    copy = harness.copy_bandwidth(device) / 1e9  # GB/s
    gbps = useful / us / 1e3
    print(f"{props.name}; copy {copy:.0f} GB/s")
    print(f"TMA boxes [16, 128] + [16, 16] of {args.tokens} tokens x 8 heads x 132 bytes, "
          f"{args.stages} stages, {per_head} programs a head: {us:.1f} us, "
          f"{gbps:.0f} GB/s of the rows' bytes, {gbps / copy:.3f} of copy")  # fmt: skip


if __name__ == "__main__":
    main()
