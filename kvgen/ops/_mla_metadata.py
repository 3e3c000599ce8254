"""``get_mla_metadata``: a load-balanced split-KV schedule, computed on the device (no sync).

kvgen's metadata layout (its own; FlashMLA's is opaque too). The work of sequence b is
``cost_b = ceil(seqlen_b / BLOCK_N) + FIXED_COST`` units (KV blocks, plus a fixed charge for
loading Q and writing the output). The units of all sequences, laid end to end in batch order,
are cut into ``num_sm_parts`` equal ranges, one per persistent work unit (about one per SM and
head group). Row p of ``tile_scheduler_metadata`` ([num_sm_parts, 8] int32) describes part p:

    0 begin_batch   1 begin_block   2 end_batch   3 end_block (exclusive; the part covers
    blocks [begin_block, ...) of begin_batch up to blocks [..., end_block) of end_batch)
    4 begin_split   (the index, within begin_batch's splits, of this part's first piece)
    5 units         (cost units in the part)     6, 7 reserved (0)

A part whose range is empty (more parts than work) has begin_batch = batch and end_batch =
batch - 1, so that a loop ``for b in range(begin_batch, end_batch + 1)`` does nothing.
``num_splits`` ([batch + 1] int32) is the prefix sum of the number of pieces each sequence is
cut into: sequence b's partial results are ``num_splits[b] .. num_splits[b + 1] - 1``. A
sequence in one piece has no partial result: the decode writes its output directly and the
combine step skips it (the wgmma variant; the others write a partial result for it, which the
combine copies). Where little balance is lost, whole sequences are given to the parts
(``schedule``'s "auto" policy, used for the wgmma variant), so that a batch of similar lengths
needs no combining at all.
"""

from __future__ import annotations

import dataclasses

import torch

from kvgen._math import cdiv
from kvgen.families.mla_decode import SCHED_BLOCK as BLOCK_N  # KV tokens per unit
from kvgen.ops._library import define
from kvgen.ops._mla_choice import split_policy

METADATA_SIZE = 8
FIXED_COST = 5  # per sequence: Q load, output write and combine, in KV-block units
HEADS_PER_PART = 64  # query heads one work unit processes (FlashMLA's tile)


def num_sm_parts(
    num_sms: int, num_heads_per_head_k: int, num_heads_k: int, split_factor: int = 1
) -> int:
    """Work units: ``split_factor`` per SM (the tuned split policy; FlashMLA uses 1), shared by
    the head tiles of HEADS_PER_PART query heads."""
    head_tiles = cdiv(num_heads_per_head_k, HEADS_PER_PART)
    return max(1, num_sms * split_factor // (num_heads_k * head_tiles))


def schedule(
    cache_seqlens: torch.Tensor, parts: int, policy: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The schedule as torch ops on ``cache_seqlens``'s device (no host round trip).

    ``policy``: "split" cuts the units into equal ranges, splitting sequences where the cuts
    fall; "whole" gives every sequence whole to the part its first unit falls in (no
    sequence is split: the wgmma variant writes every result directly and the combine step has
    nothing to merge); "auto" (``get_mla_metadata``'s for the wgmma variant) takes "whole"
    where no part then carries more than ``ceil(total / parts) + FIXED_COST`` units (the
    imbalance costs less than the splits it saves, e.g. a batch of equal lengths with about as
    many sequences as parts), "split" otherwise. The choice is made on the device too.
    """
    if policy not in ("auto", "split", "whole"):
        raise ValueError(f"policy must be 'auto', 'split' or 'whole', not {policy!r}")
    dev = cache_seqlens.device
    seqlens = cache_seqlens.to(torch.int64)
    batch = seqlens.shape[0]
    blocks = (seqlens + BLOCK_N - 1) // BLOCK_N
    cost = blocks + FIXED_COST
    end = torch.cumsum(cost, 0)  # exclusive end of each sequence's units
    start = end - cost
    total = end[-1:] if batch else torch.zeros(1, dtype=torch.int64, device=dev)
    per_part = torch.clamp((total + parts - 1) // parts, min=1)  # [1]
    p = torch.arange(parts, device=dev, dtype=torch.int64)
    lo = torch.minimum(p * per_part, total)  # unit range [lo, hi) of each part
    hi = torch.minimum(lo + per_part, total)

    def locate(u):  # (batch, block) of global unit u; units past a sequence's blocks -> its end
        b = torch.searchsorted(end, u, right=True)
        b_c = torch.clamp(b, max=max(batch - 1, 0))
        off = u - start[b_c] if batch else u
        blk = torch.minimum(off, blocks[b_c]) if batch else off
        return b, blk

    begin_b, begin_blk = locate(lo)
    last_b, last_blk = locate(torch.clamp(hi - 1, min=0))
    end_blk = torch.minimum(
        last_blk + 1, blocks[torch.clamp(last_b, max=max(batch - 1, 0))] if batch else last_blk + 1
    )
    empty = hi <= lo
    begin_b = torch.where(empty, batch, begin_b)

    # Pieces per sequence: the parts whose ranges meet its units [start, end).
    first_part = start // per_part
    last_part = (end - 1) // per_part
    pieces = last_part - first_part + 1
    num_splits = torch.zeros(batch + 1, dtype=torch.int64, device=dev)
    num_splits[1:] = torch.cumsum(pieces, 0)
    begin_split = (
        torch.where(empty, 0, p - first_part[torch.clamp(begin_b, max=max(batch - 1, 0))])
        if batch
        else torch.zeros_like(p)
    )

    meta = torch.zeros(parts, METADATA_SIZE, dtype=torch.int32, device=dev)
    meta[:, 0] = begin_b.to(torch.int32)
    meta[:, 1] = torch.where(empty, 0, begin_blk).to(torch.int32)
    meta[:, 2] = torch.where(empty, batch - 1, last_b).to(torch.int32)
    meta[:, 3] = torch.where(empty, 0, end_blk).to(torch.int32)
    meta[:, 4] = begin_split.to(torch.int32)
    meta[:, 5] = (hi - lo).clamp(min=0).to(torch.int32)
    if policy == "split" or batch == 0:
        return meta, num_splits.to(torch.int32)

    # Whole sequences: sequence b goes to the part its first unit falls in.
    owner = start // per_part  # non-decreasing, < parts
    load = torch.zeros(parts, dtype=torch.int64, device=dev).scatter_add_(0, owner, cost)
    first = torch.searchsorted(owner, p)  # the part's sequences are [first, last]
    last = torch.searchsorted(owner, p, right=True) - 1
    idle = last < first
    whole = torch.zeros_like(meta)
    whole[:, 0] = torch.where(idle, batch, first).to(torch.int32)
    whole[:, 2] = torch.where(idle, batch - 1, last).to(torch.int32)
    whole[:, 3] = torch.where(idle, 0, blocks[last.clamp(min=0)]).to(torch.int32)
    whole[:, 5] = load.to(torch.int32)
    one_each = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    if policy == "whole":
        return whole, one_each
    take = load.max() <= per_part[0] + FIXED_COST  # a device bool: no sync
    return (torch.where(take, whole, meta), torch.where(take, one_each, num_splits.to(torch.int32)))


def _parts(device: torch.device, num_heads_per_head_k: int, num_heads_k: int) -> tuple[int, str]:
    """(work units, schedule policy) of a schedule on ``device``: host facts only, no data."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    elif device.type == "meta" and torch.cuda.is_available():  # shapes for this machine's GPU
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    else:
        sms = 8  # the interpreter: a few work units are enough to exercise splitting
    split, policy = split_policy(device, num_heads_per_head_k)
    return num_sm_parts(sms, num_heads_per_head_k, num_heads_k, split), policy


def _check_metadata(seqlens, num_heads_per_head_k, num_heads_k) -> tuple[int, str]:
    """The checks of ``get_mla_metadata``; (work units, policy) of the schedule."""
    from kvgen.ops import _checks as check

    check.dtype("cache_seqlens", seqlens, (torch.int32, torch.int64))
    check.ndim("cache_seqlens", seqlens, 1, "[batch]")
    for name, v in (("num_heads_per_head_k", num_heads_per_head_k), ("num_heads_k", num_heads_k)):
        if v < 1:
            raise ValueError(f"{name} must be at least 1, got {v}")
    return _parts(seqlens.device, num_heads_per_head_k, num_heads_k)


def _run_metadata(checked, seqlens, num_heads_per_head_k, num_heads_k):
    parts, policy = checked
    return schedule(seqlens, parts, policy)


def _fake_metadata(checked, seqlens, num_heads_per_head_k, num_heads_k):
    meta = seqlens.new_empty(checked[0], METADATA_SIZE, dtype=torch.int32)
    return meta, seqlens.new_empty(seqlens.shape[0] + 1, dtype=torch.int32)


_metadata_op = define(
    "get_mla_metadata(Tensor cache_seqlens, int num_heads_per_head_k, int num_heads_k) "
    "-> (Tensor, Tensor)",
    _check_metadata,
    _run_metadata,
    _fake_metadata,
)


@dataclasses.dataclass
class MLASchedMeta:
    """The schedule of FlashMLA's newer interface: ``get_mla_metadata()`` returns it empty, the
    first ``flash_mla_with_kvcache`` call fills it (``get_mla_metadata``'s tensors for that
    call's lengths and shapes, on the device: no sync) and later calls reuse it. Reuse it only
    for calls with the same ``cache_seqlens`` values (the schedule is theirs); a call whose
    shapes differ from the first one's raises ValueError."""

    tile_scheduler_metadata: torch.Tensor | None = None
    num_splits: torch.Tensor | None = None
    #: (batch, seq_len_q, num_heads_q, page_block_size, num_heads_k, causal) of the first call
    config: tuple | None = None

    def schedule(self, q, k_cache, cache_seqlens, causal: bool):
        """(tile_scheduler_metadata, num_splits) for a decode call, made on the first."""
        from kvgen.ops import _checks as check

        check.ndim("q", check.tensor("q", q), 4, "[batch, seq_len_q, num_heads_q, head_dim]")
        k_shape = "[num_blocks, page_block_size, num_heads_k, head_dim]"
        check.ndim("k_cache", check.tensor("k_cache", k_cache), 4, k_shape)
        batch, s_q, h_q, _ = q.shape
        h_kv = k_cache.shape[2]
        config = (batch, s_q, h_q, k_cache.shape[1], h_kv, causal)
        if self.config is None:
            if h_kv < 1 or h_q % h_kv:
                raise ValueError(f"num_heads_k ({h_kv}) must divide num_heads_q ({h_q})")
            meta, splits = get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv)
            self.tile_scheduler_metadata, self.num_splits, self.config = meta, splits, config
        elif config != self.config:
            names = "batch seq_len_q num_heads_q page_block_size num_heads_k causal".split()
            pairs = zip(names, config, self.config, strict=True)
            diff = ", ".join(f"{n} {a} (was {b})" for n, a, b in pairs if a != b)
            raise ValueError(
                f"tile_scheduler_metadata was filled by a call with other arguments: {diff}; "
                "use one get_mla_metadata() per set of lengths and shapes"
            )
        return self.tile_scheduler_metadata, self.num_splits


def get_mla_metadata(
    cache_seqlens: torch.Tensor | None = None,
    num_heads_per_head_k: int | None = None,
    num_heads_k: int | None = None,
):
    """FlashMLA's ``get_mla_metadata``, in both of its forms.

    ``get_mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k)`` returns
    ``(tile_scheduler_metadata, num_splits)`` for these lengths:

    Args:
        cache_seqlens: [batch] int32 (int64 accepted), on the device of the decode.
        num_heads_per_head_k: seq_len_q * num_heads_q // num_heads_k.
        num_heads_k: KV heads (1 for DeepSeek's MLA).

    Computed with device ops only: no host synchronisation, safe inside CUDA graphs' warm-up.
    The layout is documented at the top of this module. The op is
    ``torch.ops.kvgen.get_mla_metadata``; on meta tensors the schedule's shape is that for
    this machine's first GPU (the interpreter's without one).

    ``get_mla_metadata()`` (FlashMLA's newer form) returns ``(MLASchedMeta(), None)``: an empty
    schedule that the first ``flash_mla_with_kvcache`` call given it fills.
    """
    from kvgen.ops import _checks as check

    if cache_seqlens is None and num_heads_per_head_k is None and num_heads_k is None:
        return MLASchedMeta(), None
    check.tensor("cache_seqlens", cache_seqlens)
    for name, v in (("num_heads_per_head_k", num_heads_per_head_k), ("num_heads_k", num_heads_k)):
        check.int_arg(name, v)
    return _metadata_op(cache_seqlens, num_heads_per_head_k, num_heads_k)
