"""A store's floor: the same bytes moved between the same addresses, none of the format's math.

``scatter_rows`` reads each (token, head)'s input row whole and writes a row of the cache's
bytes at the token's slot, through the cache's own strides: 16 bytes an access where the
cache's address and strides are multiples of 16 bytes, else 4 (vLLM's inline-scale rows start
at multiples of 4 bytes; ``tests/_gpu_compile_check.py`` checks both), and optionally a second,
smaller row (a separate scale cache) at the same slot. What it writes is an XOR fold of the
input row's words, so that no load can be left out: with P the row's words rounded up to a
power of two (the input is read in aligned pieces of P words), word j is the XOR of the input
words i with i % P == j, and word 0 also takes those that land past the row. A store timed
against its floor in the same run tells how much of its distance from the copy bandwidth is
the access pattern (rows that are not whole 32-byte sectors, written at random slots) and how
much is the kernel's own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def scatter_rows_kernel(
    src_ptr,  # [tokens, heads, IN_W] words, contiguous
    slot_ptr,  # [tokens] int32 / int64
    dst_ptr,  # the cache's first byte (any element type; addressed in words)
    aux_ptr,  # the second cache's first byte (unused where AUX_W is 0)
    heads,
    n_slots,  # blocks * page: a slot at or past it, or below 0, is skipped
    page,
    d_block,  # dst strides, in words: block, slot in its block, head
    d_slot,
    d_head,
    a_block,  # aux strides, in words
    a_slot,
    a_head,
    IN_W: tl.constexpr,
    OUT_W: tl.constexpr,
    AUX_W: tl.constexpr,
    HEADS_P: tl.constexpr,
    OUT_P: tl.constexpr,
    AUX_P: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    valid = (slot >= 0) & (slot < n_slots)
    slot = tl.where(valid, slot, 0)
    block, off = slot // page, slot % page
    h = tl.arange(0, HEADS_P)
    j = tl.arange(0, OUT_P)
    rows = (h < heads)[:, None] & (j < OUT_W)[None, :]
    src = src_ptr.to(tl.pointer_type(tl.int32)) + (tok.to(tl.int64) * heads + h[:, None]) * IN_W
    acc = tl.zeros((HEADS_P, OUT_P), dtype=tl.int32)
    for k in tl.static_range(0, IN_W, OUT_P):  # the input row in aligned pieces of OUT_P words
        idx = k + j[None, :]
        acc ^= tl.load(src + idx, mask=(h < heads)[:, None] & (idx < IN_W), other=0)
    # the words past OUT_W fold into word 0 (so that their loads are not dropped)
    spill = tl.xor_sum(tl.where(j[None, :] >= OUT_W, acc, 0), axis=1)
    acc ^= tl.where(j[None, :] == 0, spill[:, None], 0)
    dst = dst_ptr.to(tl.pointer_type(tl.int32)) + block * d_block + off * d_slot
    tl.store(dst + h[:, None] * d_head + j[None, :], acc, mask=rows & valid)
    if AUX_W > 0:
        a = tl.arange(0, AUX_P)
        word = tl.xor_sum(acc, axis=1)
        aux = aux_ptr.to(tl.pointer_type(tl.int32)) + block * a_block + off * a_slot
        mask = (h < heads)[:, None] & (a < AUX_W)[None, :] & valid
        tl.store(aux + h[:, None] * a_head + a[None, :], word[:, None] + a[None, :], mask=mask)


def warps_for(words: int) -> int:
    """Warps for a program's ``words`` (a power of two): 4 words (16 bytes) a thread, the widest
    access, where 1-8 warps allow it."""
    return max(1, min(8, words // 128))


def _words(t: torch.Tensor, what: str, dims: int) -> tuple[int, ...]:
    """The strides of ``t``'s first ``dims`` dimensions (block, slot, head) in 4-byte words;
    its address and those strides must be whole words and the rest of it (a row) dense."""
    size, strides = t.element_size(), t.stride()[:dims]
    dense = t.dim() == dims or (t.dim() == dims + 1 and t.stride(-1) == 1)
    if not dense or t.data_ptr() % 4 or any(s * size % 4 for s in strides):
        raise ValueError(f"{what} must start and stride at multiples of 4 bytes, rows dense")
    return tuple(s * size // 4 for s in strides)


def scatter_rows(
    src: torch.Tensor,
    slots: torch.Tensor,
    cache: torch.Tensor,
    row_bytes: int,
    aux: torch.Tensor | None = None,
    aux_bytes: int = 0,
) -> None:
    """Write ``row_bytes`` at each (token, head)'s row of ``cache`` (``[blocks, page, heads,
    ...]`` or ``[blocks, page, ...]`` for one head; the row may run past the view's last
    dimension, as vLLM's inline scales do) from ``src`` ``[tokens, heads, ...]`` (contiguous,
    each (token, head) read whole), and ``aux_bytes`` at its row of ``aux`` (same leading
    dimensions) where given. Slots below 0 or past the cache are skipped."""
    tokens = slots.shape[0]
    heads = cache.shape[2] if cache.dim() == 4 else 1
    if not src.is_contiguous() or src.numel() * src.element_size() % (tokens * heads * 4):
        raise ValueError("src must be contiguous, [tokens, heads, ...] of whole words a row")
    if row_bytes % 4 or aux_bytes % 4:
        raise ValueError("row_bytes and aux_bytes must be multiples of 4")
    in_w = src.numel() * src.element_size() // (tokens * heads * 4)
    out_w, aux_w = row_bytes // 4, aux_bytes // 4
    if out_w > in_w:
        raise ValueError(f"a row of {row_bytes} bytes is wider than its input ({4 * in_w})")
    d = _words(cache, "cache", 3 if cache.dim() == 4 else 2) + (0,)
    a = (0, 0, 0) if aux is None else _words(aux, "aux", 3)
    blocks, page = cache.shape[:2]
    heads_p, out_p = triton.next_power_of_2(heads), triton.next_power_of_2(out_w)
    scatter_rows_kernel[(tokens,)](
        src,
        slots,
        cache,
        cache if aux is None else aux,
        heads,
        blocks * page,
        page,
        *d[:3],
        *a,
        IN_W=in_w,
        OUT_W=out_w,
        AUX_W=aux_w,
        HEADS_P=heads_p,
        OUT_P=out_p,
        AUX_P=triton.next_power_of_2(max(aux_w, 1)),
        num_warps=warps_for(heads_p * out_p),
    )
