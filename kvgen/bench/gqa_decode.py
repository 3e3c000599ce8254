"""``kvgen bench --ops gqa_decode``: the paged GQA decode over every per-token-head cache format,
against the copy bandwidth measured in the same run (8 KV heads x 128, block 16)."""

from __future__ import annotations

import dataclasses
import statistics

import torch

from kvgen._math import cdiv
from kvgen.bench import harness
from kvgen.formats.gqa_decode import bytes_per_token

H_KV, HEAD, PAGE = 8, 128, 16
HEADS_Q = (32, 64)
SHAPES = (("128 x 4096", 128, 4096), ("8 x 32768", 8, 32768))
#: the formats the bench reads: (label, kv axis, int4 group, layout); "inline": vLLM's rows
#: with the scales in their pad bytes (132-byte int8 / fp8 rows, 72-byte int4 ones)
FORMATS = (
    ("bf16", "auto", 0, "nhd"),
    ("int8", "int8", 0, "nhd"),
    ("fp8e4m3", "fp8e4m3", 0, "nhd"),
    ("fp8e5m2", "fp8e5m2", 0, "nhd"),
    ("int4 C32", "int4", 32, "nhd"),
    ("int8 inline", "int8", 0, "inline"),
    ("fp8e4m3 inline", "fp8e4m3", 0, "inline"),
    ("int4 C32 inline", "int4", 32, "inline"),
)
ROUNDS = 3


@dataclasses.dataclass
class GQADecodeRow:
    kv_format: str
    lengths: str
    heads: int
    total_kv: int
    bytes_per_token: int  # K and V of every KV head, codes and scales
    graph_us: float
    gbps: float  # bytes read / time
    bw_ratio: float  # of the same run's copy bandwidth
    correct: bool
    vs_bf16: float | None = None  # time / the bf16 cache's, same run
    variant: str = ""  # the variant the op took (portable, rows)


def token_bytes(kv: str, group: int, h_kv: int = H_KV, d: int = HEAD, dv: int = HEAD) -> int:
    """Bytes the decode reads per token (``kvgen.formats.gqa_decode.bytes_per_token``), at the
    bench's 8 KV heads x 128 unless told."""
    return bytes_per_token(kv, group, h_kv, d, dv)


def problem(kv, group, lengths, h_q, device, *, h_kv=H_KV, page=PAGE, seed=0,
            dtype=torch.bfloat16, layout="nhd"):  # fmt: skip
    """(q, k, v, k_scales, v_scales, block_table, cache_seqlens) with the caches written by
    kvgen's stores in ``layout``, each sequence's pages in random order; q (and a bf16 / fp16
    cache) in ``dtype``."""
    from kvgen.families.gqa_decode.verify import make_caches

    gen = torch.Generator(device=device).manual_seed(seed)
    need = [cdiv(n, page) for n in lengths]
    blocks = sum(need)
    keys = torch.randn(blocks * page, h_kv, HEAD, device=device, generator=gen)
    values = torch.randn(blocks * page, h_kv, HEAD, device=device, generator=gen)
    k, v, ks, vs, _, _ = make_caches(kv, group, keys, values, page, device, dequantize=False,
                                     dtype=dtype, layout=layout)  # fmt: skip
    del keys, values
    pages = torch.randperm(blocks, device=device, generator=gen).to(torch.int32)
    table = torch.zeros(len(lengths), max(need), dtype=torch.int32, device=device)
    i = 0
    for b, nb in enumerate(need):
        table[b, :nb] = pages[i : i + nb]
        i += nb
    q = torch.randn(len(lengths), 1, h_q, HEAD, device=device, generator=gen).to(dtype)
    sl = torch.tensor(lengths, dtype=torch.int32, device=device)
    return q, k, v, ks, vs, table, sl


def checked_problem(kv, group, h_q, device, dtype=torch.bfloat16, layout="nhd"):
    """A small batch of this format (lengths 1000, 333, 16, 1) and its float64 reference
    (out, lse): what the bench and the tuner check a result on."""
    from kvgen.formats.gqa_decode import dequantize_cache, gqa_decode

    small = problem(kv, group, [1000, 333, 16, 1], h_q, device, seed=1, dtype=dtype,
                    layout=layout)  # fmt: skip
    q, k, v, ks, vs, table, sl = small
    k_deq = dequantize_cache(k.cpu(), None if ks is None else ks.cpu(), HEAD)
    v_deq = dequantize_cache(v.cpu(), None if vs is None else vs.cpu(), HEAD)
    return small, gqa_decode(q.cpu(), k_deq, v_deq, table.cpu(), sl.cpu())


def check(kv, group, h_q, device, layout="nhd") -> bool:
    """The op on ``checked_problem``'s batch against its reference."""
    from kvgen.ops import flash_attn_with_kvcache
    from kvgen.verify import compare_attention

    (q, k, v, ks, vs, table, sl), ref = checked_problem(kv, group, h_q, device, layout=layout)
    out, lse = flash_attn_with_kvcache(
        q, k, v, cache_seqlens=sl, block_table=table, return_softmax_lse=True,
        k_scale_cache=ks, v_scale_cache=vs,
    )  # fmt: skip
    return compare_attention(out, lse, *ref)[0]


def run(device, copy_bw: float, heads=HEADS_Q, shapes=SHAPES, formats=FORMATS, progress=None,
        rounds=ROUNDS) -> list[GQADecodeRow]:  # fmt: skip
    """Every format at every shape and head count: the op (its tuned variant), CUDA-graph timed,
    each format once a round in rotated order, the median kept."""
    from kvgen.ops import flash_attn_with_kvcache
    from kvgen.ops._gqa_decode import chosen_spec

    rows = []
    for shape, batch, seqlen in shapes:
        lengths = [seqlen] * batch
        for h_q in heads:
            calls = []
            for label, kv, group, layout in formats:
                q, k, v, ks, vs, table, sl = problem(kv, group, lengths, h_q, device,
                                                     layout=layout)  # fmt: skip

                def call(q=q, k=k, v=v, ks=ks, vs=vs, table=table, sl=sl):
                    return flash_attn_with_kvcache(
                        q, k, v, cache_seqlens=sl, block_table=table, k_scale_cache=ks,
                        v_scale_cache=vs,
                    )  # fmt: skip

                spec = chosen_spec(q, k, v, cache_seqlens=sl, block_table=table, k_scale_cache=ks,
                                   v_scale_cache=vs)  # fmt: skip
                calls.append((label, kv, group, layout, call, spec.variant))
            times = {label: [] for label, *_ in calls}
            for r in range(rounds):
                for label, *_, call, _ in calls[r % len(calls) :] + calls[: r % len(calls)]:
                    t = harness.graph_time_us(lambda i, c=call: c(), 1, calls=8, replays=5)
                    times[label].append(t)
            bf16 = statistics.median(times["bf16"])
            for label, kv, group, layout, _, variant in calls:
                t = statistics.median(times[label])
                nbytes = token_bytes(kv, group) * batch * seqlen
                row = GQADecodeRow(
                    label, shape, h_q, batch * seqlen, token_bytes(kv, group), t,
                    nbytes / (t * 1e-6) / 1e9, nbytes / (t * 1e-6) / copy_bw,
                    check(kv, group, h_q, device, layout), t / bf16, variant,
                )  # fmt: skip
                rows.append(row)
                if progress:
                    progress(row)
            del calls
            torch.cuda.empty_cache()
    return rows
