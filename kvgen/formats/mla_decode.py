"""MLA decode attention over a paged cache, as FlashMLA's ``flash_mla_with_kvcache`` computes it,
in float64: the reference the decode kernels are held to.

- ``q``: [batch, seq_len_q, num_heads_q, head_dim]; ``k_cache``: [num_blocks, page_block_size,
  num_heads_k, head_dim], whose first ``head_dim_v`` channels are also V (DeepSeek MLA: 576 and
  512, one KV head). ``num_heads_k`` divides ``num_heads_q``: query head h reads KV head
  ``h // (num_heads_q // num_heads_k)``.
- Sequence b holds ``cache_seqlens[b]`` tokens; token t lives in page ``block_table[b, t //
  page_block_size]``, row ``t % page_block_size``.
- ``causal``: the seq_len_q queries are the last seq_len_q positions of the sequence, so query i
  sees keys ``j <= seqlen - seq_len_q + i`` (speculative decoding).
- ``out`` = softmax(scale * q k^T) v; ``lse`` = natural log of the softmax denominator
  (logsumexp of the scaled scores), [batch, num_heads_q, seq_len_q]. A query that sees no key
  (a sequence of length 0, or a causal row before the first token) has ``out`` = 0 and
  ``lse`` = +inf, as FlashMLA returns it.
"""

from __future__ import annotations

import math

import torch


def gather_pages(k_cache: torch.Tensor, block_table: torch.Tensor, seqlen: int, b: int):
    """The first ``seqlen`` tokens of sequence ``b``: [seqlen, num_heads_k, head_dim]."""
    page = k_cache.shape[1]
    t = torch.arange(seqlen)
    blocks = block_table[b, t // page].long().cpu()
    return k_cache[blocks, t % page].cpu()


def mla_decode(
    q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale=None, causal=False
):
    batch, s_q, h_q, d = q.shape
    scale = softmax_scale if softmax_scale is not None else d**-0.5
    out = torch.zeros(batch, s_q, h_q, head_dim_v, dtype=torch.float64)
    lse = torch.full((batch, h_q, s_q), math.inf, dtype=torch.float64)
    group = h_q // k_cache.shape[2]  # query heads per KV head
    for b in range(batch):
        n = int(cache_seqlens[b])
        if n == 0:
            continue
        kv = gather_pages(k_cache, block_table, n, b).double()  # [n, h_kv, d]
        kv = kv.repeat_interleave(group, dim=1)  # [n, h_q, d]: each query head's KV head
        scores = torch.einsum("shd,nhd->shn", q[b].double().cpu(), kv) * scale  # [s_q, h, n]
        if causal:
            limit = n - s_q + torch.arange(s_q)  # last visible key per query row
            visible = torch.arange(n)[None, :] <= limit[:, None]  # [s_q, n]
            scores = scores.masked_fill(~visible[:, None, :], -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)  # [s_q, h]
        p = torch.exp(scores - row_lse[..., None]).nan_to_num(0.0)
        out[b] = torch.einsum("shn,nhd->shd", p, kv[..., :head_dim_v])
        lse[b] = row_lse.masked_fill(row_lse == -math.inf, math.inf).transpose(0, 1)
    return out, lse
