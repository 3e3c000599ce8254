"""What ``kvgen verify`` does, and the pieces every family's check is built from.

Each family checks its variants its own way (``Family.verify``, in its folder): inputs built
to hit every corner of the format (midpoint ties, -0, all-zero groups, huge, tiny and subnormal
magnitudes, per-group scales across a wide range), caches poisoned with 0xFF and surrounded by
guard regions that must come back untouched. This module holds those shared pieces, the
dispatch through the registry, and the accuracy table of the formats.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch

from kvgen.codegen.spec import VariantSpec
from kvgen.formats import FORMATS

GUARD_BYTES = 4096
POISON = 0xFF


@dataclasses.dataclass
class GuardedCache:
    """A cache view inside a larger poisoned buffer: guards before, after and between blocks."""

    backing: torch.Tensor  # uint8, 1-D
    view: torch.Tensor

    def rebuild(self, backing: torch.Tensor) -> torch.Tensor:
        """The same view into another backing buffer (a clone, or a copy on another device)."""
        return backing.view(self.view.dtype).as_strided(
            self.view.shape, self.view.stride(), self.view.storage_offset()
        )

    def fresh_copy(self) -> GuardedCache:
        backing = self.backing.clone()
        return GuardedCache(backing, self.rebuild(backing))


def make_cache(
    layout: str,
    num_slots: int,
    pitch: int,
    device: torch.device | str,
    block_size: int = 16,
    gap_rows: int = 3,
) -> GuardedCache:
    """A poisoned cache: ``paged`` has ``gap_rows`` of other layers' rows between blocks."""
    if layout == "paged":
        blocks = math.ceil(num_slots / block_size)
        stride_rows = block_size + gap_rows
        size = GUARD_BYTES * 2 + blocks * stride_rows * pitch
        backing = torch.full((size,), POISON, dtype=torch.uint8, device=device)
        view = backing.as_strided(
            (blocks, block_size, pitch), (stride_rows * pitch, pitch, 1), GUARD_BYTES
        )
    else:
        backing = torch.full(
            (GUARD_BYTES * 2 + num_slots * pitch,), POISON, dtype=torch.uint8, device=device
        )
        view = backing[GUARD_BYTES : GUARD_BYTES + num_slots * pitch].view(num_slots, pitch)
    return GuardedCache(backing, view)


def num_slots_of(cache: torch.Tensor, pitch: int) -> int:
    return cache.shape[0] * cache.shape[1] if cache.ndim == 3 else cache.numel() // pitch


def make_slots(tokens: int, num_slots: int, device, dtype=torch.int64, seed: int = 0):
    """Distinct random slots, with PAD_SLOT_ID (-1) and out-of-range entries mixed in."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=gen)[:tokens].to(torch.int64)
    if tokens >= 4:
        slots[1] = -1
        slots[tokens // 2] = num_slots  # one past the end
        slots[-1] = num_slots + 12345
    return slots.to(dtype).to(device)


@dataclasses.dataclass
class Result:
    name: str
    passed: bool
    mismatched: int  # bytes (stores) or elements (readers) that differ from the reference
    max_error: float  # max |kernel - reference| in dequantized values
    detail: str = ""


def guarded(mem_shape, dtype, device, perm=None) -> GuardedCache:
    """A poisoned (0xFF bytes) tensor of memory shape ``mem_shape``, viewed through ``perm``."""
    n = math.prod(mem_shape) * dtype.itemsize
    backing = torch.full((2 * GUARD_BYTES + n,), POISON, dtype=torch.uint8, device=device)
    mem = backing[GUARD_BYTES : GUARD_BYTES + n].view(dtype).view(mem_shape)
    return GuardedCache(backing, mem.permute(perm) if perm else mem)


def block_table(seqlens, page: int, gen) -> tuple[int, torch.Tensor]:
    """(number of pages, block table) for the decodes' checks: each sequence's pages in random
    order, two spare."""
    need = [-(-n // page) for n in seqlens]
    blocks = sum(need) + 2
    pages = torch.randperm(blocks, generator=gen).to(torch.int32)
    table = torch.zeros(len(seqlens), max(max(need), 1), dtype=torch.int32)
    i = 0
    for b, nb in enumerate(need):
        table[b, :nb] = pages[i : i + nb]
        i += nb
    return blocks, table


def compare_attention(out, lse, ref_out, ref_lse) -> tuple[bool, float, str]:
    """A decode's (out, lse) against the float64 reference: (passed, relative error of out,
    what failed). out within 1e-2 (relative), lse within 1e-3, +inf for the rows that see no
    key."""
    rel = float((out.cpu().double() - ref_out).norm() / ref_out.norm())
    finite = torch.isfinite(ref_lse)
    lse_err = float((lse.cpu().double()[finite] - ref_lse[finite]).abs().max())
    empty_ok = bool((lse.cpu()[~finite] == math.inf).all())
    passed = rel < 1e-2 and lse_err < 1e-3 and empty_ok
    return passed, rel, "" if passed else f"lse error {lse_err:.2e}, empty rows ok: {empty_ok}"


def gqa_accuracy_table(batch: int = 4, seqlen: int = 256, h_kv: int = 8, group: int = 4,
                       head: int = 128, seed: int = 0):  # fmt: skip
    """The GQA decode's output error over each per-token-head cache format against the bf16
    cache: the float64 reference decode (``kvgen.formats.gqa_decode``) over the dequantized K and
    V caches of each format and over the bf16 ones, relative error of ``out`` and max error of
    ``lse``. Data: keys with a few outlier channels (x10), Gaussian values, bf16 queries;
    ``h_kv`` KV heads of ``head`` channels, ``group`` query heads a KV head."""
    from kvgen.formats import gqa_decode
    from kvgen.formats import per_token_head as pth

    gen = torch.Generator().manual_seed(seed)
    n = batch * seqlen
    keys = torch.randn(n, h_kv, head, generator=gen)
    outliers = torch.randperm(head, generator=gen)[:4]
    keys[..., outliers] *= 10.0
    values = torch.randn(n, h_kv, head, generator=gen)
    keys, values = keys.to(torch.bfloat16).float(), values.to(torch.bfloat16).float()
    q = torch.randn(batch, 1, h_kv * group, head, generator=gen).to(torch.bfloat16)
    table = torch.arange(batch, dtype=torch.int32)[:, None]  # one page of seqlen keys each
    lengths = torch.full((batch,), seqlen, dtype=torch.int32)

    def scaled(dtype):
        def roundtrip(x):
            return pth.dequantize_per_token_head(*pth.quantize_per_token_head(x, dtype))

        return roundtrip

    def int4(channels):
        def roundtrip(x):
            return pth.dequantize_int4(*pth.quantize_int4(x, channels), head)

        return roundtrip

    formats = [("bf16", "auto", 0, lambda x: x)]
    formats += [(name, kv, 0, scaled(dt)) for name, kv, dt in (
        ("int8", "int8", torch.int8),
        ("fp8 e4m3", "fp8e4m3", torch.float8_e4m3fn),
        ("fp8 e5m2", "fp8e5m2", torch.float8_e5m2),
    )]  # fmt: skip
    formats += [(f"int4, {c} ch/scale", "int4", c, int4(c)) for c in pth.INT4_CHANNELS]

    def decode(k, v):
        shape = (batch, seqlen, h_kv, head)
        return gqa_decode.gqa_decode(q, k.double().reshape(shape), v.double().reshape(shape),
                                     table, lengths)  # fmt: skip

    ref_out, ref_lse = decode(keys, values)
    rows = []
    for name, kv, channels, roundtrip in formats:
        out, lse = decode(roundtrip(keys), roundtrip(values))
        rows.append(
            {
                "format": name,
                "bytes_per_token": gqa_decode.bytes_per_token(kv, channels, h_kv, head, head),
                "out_rel_err": float((out - ref_out).norm() / ref_out.norm()),
                "lse_max_err": float((lse - ref_lse).abs().max()),
            }
        )
    return rows


def verify(spec: VariantSpec, device) -> Result:
    """``spec``'s family's check on ``device``; a crash is a failed result, not an error."""
    from kvgen import registry

    try:
        with warnings.catch_warnings():
            # numpy, under the interpreter, warns on the overflow the huge-magnitude rows are
            # there to cause (dequantized 6 * 2^126 is inf in fp32, as the reference agrees).
            warnings.simplefilter("ignore", RuntimeWarning)
            return registry.family(spec.family).verify(spec, device)
    except Exception as exc:  # a crash is a failed variant, reported, not a dead table
        return Result(spec.name, False, -1, math.inf, f"{type(exc).__name__}: {exc}")


def _init_worker() -> None:
    """A verify worker process: one torch thread (the workers are the parallelism)."""
    torch.set_num_threads(1)


def verify_all(specs, device: str, jobs: int = 1, progress=None) -> list[Result]:
    """``verify`` of each spec, in order; with ``jobs`` > 1 in that many worker processes
    (spawned: each imports kvgen afresh, so a spec's family must be importable, as the
    built-in and entry-point families are). ``progress(done, total, name)`` after each."""
    specs = list(specs)
    if jobs <= 1 or len(specs) <= 1:
        results = []
        for i, spec in enumerate(specs, 1):
            if progress:
                progress(i, len(specs), spec.name)
            results.append(verify(spec, device))
        return results
    import concurrent.futures as cf
    import multiprocessing

    results: list[Result | None] = [None] * len(specs)
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_init_worker) as pool:
        futures = {pool.submit(verify, s, device): i for i, s in enumerate(specs)}
        for done, fut in enumerate(cf.as_completed(futures), 1):
            i = futures[fut]
            try:
                results[i] = fut.result()
            except Exception as exc:  # the worker died (or the spec could not be sent)
                detail = f"{type(exc).__name__}: {exc}"
                results[i] = Result(specs[i].name, False, -1, math.inf, detail)
            if progress:
                progress(done, len(specs), specs[i].name)
    return results


def report(results: list[Result], arch: str, target: str) -> dict:
    """``kvgen verify --json``'s document."""
    failed = sum(not r.passed for r in results)
    return {
        "arch": arch,
        "target": target,
        "passed": len(results) - failed,
        "failed": failed,
        "results": [dataclasses.asdict(r) for r in results],
    }


def accuracy_table(rows: int = 2048, width: int = 512, seed: int = 0) -> list[dict]:
    """SNR (dB) and max error of quantize -> dequantize for every format, on three data sets.

    Runs the pure-torch references, which every kernel matches byte for byte (the tests show
    it). "max err / amax" is the largest |x - x_hat| over the absolute maximum of its row.
    """
    gen = torch.Generator().manual_seed(seed)
    gauss = torch.randn(rows, width, generator=gen)
    # Student's t with 3 degrees of freedom, z / sqrt(chi2_3 / 3), drawn from the seeded generator
    chi2 = (torch.randn(3, rows, width, generator=gen) ** 2).sum(0)
    t3 = torch.randn(rows, width, generator=gen) / (chi2 / 3).sqrt()
    outliers = torch.randn(rows, width, generator=gen)
    cols = torch.randint(0, width, (rows, 4), generator=gen)
    outliers.scatter_(1, cols, outliers.gather(1, cols).sign() * 50.0)
    datasets = {"gaussian": gauss, "student-t(3)": t3, "50x outlier channels": outliers}

    roundtrips = {
        label: (lambda x, f=fmt, g=group: f.roundtrip(x, g))
        for fmt in FORMATS.values()
        for label, group in fmt.accuracy_entries()
    }
    table = []
    for fmt, roundtrip in roundtrips.items():
        for data_name, x in datasets.items():
            xh = roundtrip(x)
            err = x - xh
            snr = 10 * math.log10(float((x**2).sum()) / max(float((err**2).sum()), 1e-30))
            rel = float((err.abs() / x.abs().amax(-1, keepdim=True)).max())
            table.append({"format": fmt, "data": data_name, "snr_db": snr, "max_err_amax": rel})
    return table


def mla_accuracy_table(batch: int = 4, seqlen: int = 256, heads: int = 16, seed: int = 0):
    """The MLA decode's output error over each cache format against the bf16 cache: the
    float64 reference decode (``kvgen.formats.mla_decode``) over the dequantized cache of each
    format and over the bf16 cache, relative error of ``out`` and max error of ``lse``. Data:
    latents with a few outlier channels, RoPE'd keys, bf16 queries; one KV head, 576 / 512."""
    from kvgen.formats import mla_cache, mla_decode

    gen = torch.Generator().manual_seed(seed)
    n = batch * seqlen
    kv_c = torch.randn(n, 512, generator=gen)
    outliers = torch.randperm(512, generator=gen)[:8]
    kv_c[:, outliers] *= 20.0
    # RoPE'd keys: pairs of channels rotated by position-dependent angles
    pe = torch.randn(n, 32, 2, generator=gen)
    pos = torch.arange(n, dtype=torch.float32)[:, None] % seqlen
    theta = pos * torch.pow(10000.0, -torch.arange(32) / 32.0)[None, :]
    cos, sin = theta.cos(), theta.sin()
    k_pe = torch.stack(
        [pe[..., 0] * cos - pe[..., 1] * sin, pe[..., 0] * sin + pe[..., 1] * cos], dim=-1
    ).reshape(n, 64)
    kv_c, k_pe = kv_c.to(torch.bfloat16), k_pe.to(torch.bfloat16)
    q = torch.randn(batch, 1, heads, 576, generator=gen).to(torch.bfloat16)
    table = torch.arange(batch, dtype=torch.int32)[:, None]
    lengths = torch.full((batch,), seqlen, dtype=torch.int32)
    k_scale = (torch.cat([kv_c, k_pe], 1).float().abs().amax() / 448.0).reshape(1)
    caches = {
        ("bf16", 1152): torch.cat([kv_c, k_pe], 1).float(),
        ("fp8_ds_mla", 656): mla_cache.dequantize_fp8_ds_mla(
            mla_cache.quantize_fp8_ds_mla(kv_c, k_pe)
        ),
        ("fp8 (per tensor)", 576): mla_cache.dequantize_fp8_per_tensor(
            mla_cache.quantize_fp8_per_tensor(kv_c, k_pe, k_scale), k_scale
        ),
        ("mxfp4, group 32, bf16 RoPE", 400): mla_cache.dequantize_mxfp4_rope(
            mla_cache.quantize_mxfp4_rope(kv_c, k_pe)
        ),
    }

    def decode(rows):
        k = rows.double().reshape(batch, seqlen, 1, 576)
        return mla_decode.mla_decode(q, k, table, lengths, 512)

    ref_out, ref_lse = decode(caches[("bf16", 1152)])
    out_rows = []
    for (name, row_bytes), rows in caches.items():
        out, lse = decode(rows)
        rel = float((out - ref_out).norm() / ref_out.norm())
        out_rows.append(
            {
                "format": name,
                "bytes_per_token": row_bytes,
                "out_rel_err": rel,
                "lse_max_err": float((lse - ref_lse).abs().max()),
            }
        )
    return out_rows
