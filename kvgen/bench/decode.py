"""``kvgen bench --ops decode``: MLA decode against the copy bandwidth and the bf16 matmul rate
measured in the same run, FlashMLA's headline shapes."""

from __future__ import annotations

import dataclasses
import functools
import statistics

import torch

from kvgen._math import cdiv
from kvgen.bench import harness

BATCH, PAGE, SEQLEN, HEAD_DIM, HEAD_DIM_V = 128, 64, 4096, 576, 512
HEADS = (16, 32, 64, 128)
#: the quantized MLA caches the op reads, and the bytes of a token's row in each
ROW_BYTES = {"bf16": 2 * HEAD_DIM, "fp8_ds_mla": 656, "fp8": HEAD_DIM, "mxfp4": 400}
K_SCALE = 0.01  # the per-tensor fp8 cache's scale (the bench's keys are N(0, 1))
ROUNDS = 5  # timings of each caller, in rotated order


@dataclasses.dataclass
class DecodeRow:
    variant: str
    lengths: str
    heads: int
    seq_len_q: int
    total_kv: int
    graph_us: float
    gbps: float  # KV bytes read / time
    tflops: float
    bw_ratio: float
    mm_ratio: float
    correct: bool
    kv_format: str = "bf16"
    bytes_per_token: int = 2 * HEAD_DIM
    vs_bf16: float | None = None  # time / the op's time over the bf16 cache, same run


def matmul_rate(device, n: int = 8192) -> float:
    """bf16 dense matmul rate (FLOP/s) on random data, CUDA-graph timed."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    t = harness.graph_time_us(lambda i: torch.mm(a, b, out=c), 1, calls=3, replays=5)
    return 2 * n**3 / (t * 1e-6)


def mixed_lengths(total: int, batch: int, seed: int = 0) -> list[int]:
    """``batch`` lengths in 1..16384 summing to ``total`` (the equal case's KV)."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.rand(batch, generator=gen) ** 2 + 0.02
    lengths = (raw / raw.sum() * total).round().clamp(1, 16384).long()
    lengths[0] += total - int(lengths.sum())
    return [int(x) for x in lengths.clamp(1, 16384)]


def _make(lengths, heads, device, dtype=torch.bfloat16, seed=0, h_kv=1):
    """(q, k_cache, block_table, cache_seqlens): ``heads`` query heads for each of ``h_kv`` KV
    heads, each sequence's pages in random order."""
    need = [cdiv(n, PAGE) for n in lengths]
    blocks = sum(need)
    k_cache = torch.randn(blocks, PAGE, h_kv, HEAD_DIM, device=device, dtype=dtype)
    pages = torch.randperm(blocks, device=device).to(torch.int32)
    table = torch.zeros(len(lengths), max(need), dtype=torch.int32, device=device)
    i = 0
    for b, nb in enumerate(need):
        table[b, :nb] = pages[i : i + nb]
        i += nb
    q = torch.randn(len(lengths), 1, heads * h_kv, HEAD_DIM, device=device, dtype=dtype)
    sl = torch.tensor(lengths, dtype=torch.int32, device=device)
    return q, k_cache, table, sl


def _callers(device, k, fmt="bf16", k_scale=None, variants=None, heads=None, unoffered=False):
    """(label, call) pairs for the 576/512 decode (bf16 queries) on cache ``k`` in format
    ``fmt``: every variant this arch has for that cache (of ``variants``, default all; with
    ``unoffered``, also those kvgen generates but does not offer yet, and a rows module's
    kernels up to the heads they take (``UNOFFERED_MAX_HEADS``); with ``heads``, those whose
    launcher ``accepts`` one query of that many heads), launched
    directly with its tuned (or default) meta-parameters, and ``auto`` (``auto <fmt>`` for a
    quantized cache): the op, whose wrapper picks the variant. ``call(q, table, seqlens, meta,
    splits) -> (out, lse)``."""
    from kvgen import runtime
    from kvgen.codegen import load
    from kvgen.codegen.spec import SpecError
    from kvgen.families import mla_decode as md
    from kvgen.ops._mla_choice import accepts

    arch, target = runtime.target_of(device)
    scale = HEAD_DIM**-0.5
    cls = {
        "bf16": md.MLADecodeSpec,
        "fp8_ds_mla": md.MLADecodeDSMLASpec,
        "fp8": md.MLADecodeFP8Spec,
        "mxfp4": md.MLADecodeMXFP4Spec,
    }[fmt]
    extra = {"k_scale": k_scale} if fmt == "fp8" else {}
    out = []
    for v in md.VARIANTS if unoffered else md.variants_for("auto" if fmt == "bf16" else fmt):
        if variants is not None and v not in variants:
            continue
        try:
            spec = cls(HEAD_DIM, HEAD_DIM_V, "bf16", v, arch, target)
        except SpecError:
            continue
        mod = load(spec)
        # unoffered: also the heads a rows module's kernels take beyond what the op gives them
        limit = {}
        if unoffered and hasattr(mod, "UNOFFERED_MAX_HEADS"):
            limit = {"max_heads": mod.UNOFFERED_MAX_HEADS}
        if heads is not None:
            probe = torch.empty(1, 1, heads, HEAD_DIM, dtype=torch.bfloat16, device="meta")
            if limit and mod.accepts(probe, k, **limit) is not None:
                continue
            if not limit and not accepts(spec, k, heads, probe):
                continue
        launch = functools.partial(mod.launch, **limit)

        def call(q, table, sl, meta, splits, launch=launch, spec=spec):
            mp = runtime.meta_params(spec, rows=q.shape[1] * q.shape[2])
            return launch(q, k, table, sl, meta, splits, scale, False, **mp, **extra)

        out.append((spec.name, call))
        if limit and hasattr(mod, "split_kernel_wide") and (heads or 0) <= 16:
            # the rows kernel of two pages a tile, where the op takes the one of one page
            two = functools.partial(launch, pages_per_tile=2)
            out.append((f"{spec.name} pages_per_tile=2", functools.partial(call, launch=two)))
    if fmt == "bf16":
        from kvgen.ops import flash_mla_with_kvcache

        def auto(q, table, sl, meta, splits):
            return flash_mla_with_kvcache(q, k, table, sl, HEAD_DIM_V, meta, splits)

        out.append(("auto", auto))
    else:
        out.append((f"auto {fmt}", _quantized_caller(k, fmt, k_scale)))
    return out


def quantized_caches(
    k: torch.Tensor, k_scale: torch.Tensor, formats=("fp8_ds_mla", "fp8", "mxfp4")
) -> dict[str, torch.Tensor]:
    """The bf16 cache ``k`` [blocks, page, 1, 576] in each quantized format of ``formats``,
    written by kvgen's own stores: fp8_ds_mla and per-tensor fp8 by ``concat_and_cache_mla``;
    MXFP4 (group 32, bf16 RoPE) by ``store_mxfp4_mla(..., k_pe=)``."""
    from kvgen.ops import concat_and_cache_mla, store_mxfp4_mla

    blocks, page = k.shape[:2]
    flat = k.reshape(-1, HEAD_DIM)
    kv_c, k_pe = flat[:, :HEAD_DIM_V], flat[:, HEAD_DIM_V:]
    slots = torch.arange(flat.shape[0], device=k.device)
    out = {}
    for fmt in [f for f in ("fp8_ds_mla", "fp8") if f in formats]:
        c = torch.empty(blocks, page, 1, ROW_BYTES[fmt], dtype=torch.uint8, device=k.device)
        concat_and_cache_mla(kv_c, k_pe, c, slots, fmt, k_scale)
        out[fmt] = c
    if "mxfp4" in formats:
        mx = torch.empty(blocks, page, ROW_BYTES["mxfp4"], dtype=torch.uint8, device=k.device)
        store_mxfp4_mla(kv_c, slots, mx, k_pe=k_pe)
        out["mxfp4"] = mx.reshape(blocks, page, 1, ROW_BYTES["mxfp4"])
    return out


def dequantized(fmt: str, cache: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """What the decode attends over for a quantized ``cache``: [blocks, page, 1, 576] bf16."""
    from kvgen.formats import mla_cache

    rows = cache.reshape(-1, cache.shape[-1])
    if fmt == "fp8_ds_mla":
        deq = mla_cache.dequantize_fp8_ds_mla(rows)
    elif fmt == "fp8":
        deq = mla_cache.dequantize_fp8_per_tensor(rows, k_scale)
    else:
        deq = mla_cache.dequantize_mxfp4_rope(rows)
    return deq.to(torch.bfloat16).reshape(*cache.shape[:3], HEAD_DIM)


def _row(label, name, lengths, h, t, ok, copy_bw, mm_rate, fmt="bf16") -> DecodeRow:
    total = sum(lengths)
    kv_bytes = total * ROW_BYTES[fmt]
    flops = 2 * h * total * (HEAD_DIM + HEAD_DIM_V)
    return DecodeRow(
        label,
        name,
        h,
        1,
        total,
        t,
        kv_bytes / (t * 1e-6) / 1e9,
        flops / (t * 1e-6) / 1e12,
        kv_bytes / (t * 1e-6) / copy_bw,
        flops / (t * 1e-6) / mm_rate,
        ok,
        fmt,
        ROW_BYTES[fmt],
    )


def _quantized_caller(cache, fmt, k_scale):
    from kvgen.ops import flash_mla_with_kvcache

    scale = k_scale if fmt == "fp8" else None

    def call(q, table, sl, meta, splits):
        return flash_mla_with_kvcache(
            q, cache, table, sl, HEAD_DIM_V, meta, splits, kv_format=fmt, k_scale=scale
        )

    return call


def _graph_us(call, args) -> float:
    return harness.graph_time_us(lambda i: call(*args), 1, calls=8, replays=5)


def _correct(call, q, table, sl, h, ref) -> bool:
    """``call``'s out on the first sequences against the float64 reference ``ref``."""
    from kvgen.ops import get_mla_metadata

    sub = slice(0, ref.shape[0])
    m2, s2 = get_mla_metadata(sl[sub], h, 1)
    out, _ = call(q[sub], table[sub], sl[sub], m2, s2)
    return bool((out.cpu().double() - ref).norm() / ref.norm() < 1e-2)


def run(
    device,
    copy_bw: float,
    mm_rate: float,
    heads=HEADS,
    progress=None,
    variants=None,
    batches=("equal", "mixed"),
    rounds=ROUNDS,
    unoffered=False,
) -> list[DecodeRow]:
    """Every variant (and the op's own choice, ``auto``) on the equal and mixed batches, and
    the op over each quantized cache of the same keys (``auto fp8_ds_mla``, ...), with its time
    relative to the op's over the bf16 cache. ``variants`` (default all) and ``batches`` (of
    "equal", "mixed") narrow the run; ``unoffered`` adds the variants kvgen generates but does
    not offer yet (launched directly; the op does not take them).

    Each caller is timed once a round, ROUNDS rounds, the order rotated each round,
    and its median kept; each timing starts after the graph has run for a while on its own
    (``harness.graph_time_us``'s settle), since the H200's clocks follow the load that came
    before: the op's row, timed right after the wgmma variant's row with the same kernels, read
    up to 9 % slower than it."""
    from kvgen.formats.mla_decode import mla_decode
    from kvgen.ops import get_mla_metadata

    rows = []
    equal = [SEQLEN] * BATCH
    named = {"equal": ("equal 4096", equal)}
    named["mixed"] = ("mixed 1-16384", mixed_lengths(sum(equal), BATCH))
    for name, lengths in (named[b] for b in batches):
        for h in heads:
            q, k, table, sl = _make(lengths, h, device)
            sub = slice(0, 3)  # the float64 reference runs on the CPU: a few sequences
            ref, _ = mla_decode(q[sub].cpu(), k.cpu(), table[sub].cpu(), sl[sub].cpu(), HEAD_DIM_V)
            callers = [
                (label, call, "bf16", ref)
                for label, call in _callers(
                    device, k, variants=variants, heads=h, unoffered=unoffered
                )  # fmt: skip
            ]
            k_scale = torch.tensor([K_SCALE], device=device)
            for fmt, cache in quantized_caches(k, k_scale).items():
                deq = dequantized(fmt, cache, k_scale).cpu()
                fmt_ref, _ = mla_decode(
                    q[sub].cpu(), deq, table[sub].cpu(), sl[sub].cpu(), HEAD_DIM_V
                )  # (over the dequantized cache: what the op attends over)
                for label, call in _callers(device, cache, fmt, k_scale, variants, h, unoffered):
                    callers.append((label, call, fmt, fmt_ref))
            meta, splits = get_mla_metadata(sl, h, 1)
            args = (q, table, sl, meta, splits)
            times = {label: [] for label, *_ in callers}
            for r in range(min(len(callers), rounds)):
                for label, call, *_ in callers[r:] + callers[:r]:
                    times[label].append(_graph_us(call, args))
            bf16_time = statistics.median(times["auto"])
            for label, call, fmt, fmt_ref in callers:
                ok = _correct(call, q, table, sl, h, fmt_ref)
                t = statistics.median(times[label])
                row = _row(label, name, lengths, h, t, ok, copy_bw, mm_rate, fmt)
                row.vs_bf16 = t / bf16_time
                rows.append(row)
                if progress:
                    progress(row)
            del q, k, table, sl, args
            torch.cuda.empty_cache()
    return rows
