"""Paged GQA decode attention over the per-token-head caches, in float64: the reference the GQA
decode kernels are held to (docs/formats.md, "GQA paged decode caches").

- ``q``: [batch, seq_len_q, num_heads_q, head_size]; ``k_cache``: [num_blocks, block_size,
  num_kv_heads, head_size] and ``v_cache``: [..., head_size_v], both already dequantized
  (``dequantize_cache``). Query head h reads KV head ``h // (num_heads_q // num_kv_heads)``.
- Sequence b holds ``cache_seqlens[b]`` tokens; token t lives in page ``block_table[b, t //
  block_size]``, row ``t % block_size``.
- ``causal``: the seq_len_q queries are the sequence's last positions: query i sees keys
  ``j <= seqlen - seq_len_q + i``.
- ``out`` = softmax(softmax_scale * q k^T) v, [batch, seq_len_q, num_heads_q, head_size_v];
  ``lse`` = the natural log of the softmax denominator, [batch, num_heads_q, seq_len_q]. A query
  that sees no key has ``out`` 0 and ``lse`` +inf.
"""

from __future__ import annotations

import math

import torch

from kvgen._math import cdiv
from kvgen.formats import per_token_head
from kvgen.formats.mla_decode import gather_pages


def bytes_per_token(kv: str, group: int, h_kv: int, d: int, dv: int) -> int:
    """Bytes a decode reads per token of a cache in format ``kv`` (``"auto"``: 16-bit values;
    int8 / fp8: one-byte codes and an fp32 scale per token and head; int4: packed codes and an
    fp16 scale per ``group`` channels), K and V of every KV head."""
    if kv == "auto":
        return h_kv * (d + dv) * 2
    if kv == "int4":
        return h_kv * (cdiv(d, 2) + cdiv(dv, 2) + 2 * (cdiv(d, group) + cdiv(dv, group)))
    return h_kv * (d + dv + 8)


def dequantize_cache(cache: torch.Tensor, scales: torch.Tensor | None, head_size: int):
    """fp32 [num_blocks, block_size, num_kv_heads, head_size] of a cache as the stores wrote
    it: bf16 / fp16 as they are; int8 / fp8 codes times their (token, head) fp32 scale; packed
    int4 levels times their group's fp16 scale."""
    if scales is None:
        return cache.float()
    if cache.dtype == torch.uint8:
        return per_token_head.dequantize_int4(cache.cpu(), scales.cpu(), head_size)
    return per_token_head.dequantize_per_token_head(cache.cpu(), scales.cpu())


def gqa_decode(q, k_cache, v_cache, block_table, cache_seqlens, softmax_scale=None, causal=False):
    """(out, lse) in float64 over dequantized caches (see the module's docstring)."""
    batch, s_q, h_q, d = q.shape
    dv = v_cache.shape[3]
    scale = softmax_scale if softmax_scale is not None else d**-0.5
    group = h_q // k_cache.shape[2]
    out = torch.zeros(batch, s_q, h_q, dv, dtype=torch.float64)
    lse = torch.full((batch, h_q, s_q), math.inf, dtype=torch.float64)
    for b in range(batch):
        n = int(cache_seqlens[b])
        if n == 0:
            continue
        k = gather_pages(k_cache, block_table, n, b).double().repeat_interleave(group, dim=1)
        v = gather_pages(v_cache, block_table, n, b).double().repeat_interleave(group, dim=1)
        scores = torch.einsum("shd,nhd->shn", q[b].double().cpu(), k) * scale  # [s_q, h_q, n]
        if causal:
            limit = n - s_q + torch.arange(s_q)
            visible = torch.arange(n)[None, :] <= limit[:, None]
            scores = scores.masked_fill(~visible[:, None, :], -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)  # [s_q, h_q]
        p = torch.exp(scores - row_lse[..., None]).nan_to_num(0.0)
        out[b] = torch.einsum("shn,nhd->shd", p, v)
        lse[b] = row_lse.masked_fill(row_lse == -math.inf, math.inf).transpose(0, 1)
    return out, lse
