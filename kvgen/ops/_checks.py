"""Argument checks shared by the ops: every failure names the argument and what was expected."""

from __future__ import annotations

import torch

from kvgen import _dtypes


def dtype_name(dtype: torch.dtype) -> str:
    return _dtypes.NAME.get(dtype, str(dtype).removeprefix("torch."))


def tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def tensors(**named: object) -> None:
    """``tensor`` for each keyword argument (the public functions' first check: the operators'
    own argument parsing would say less)."""
    for name, value in named.items():
        tensor(name, value)


def dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        want = ", ".join(str(d) for d in allowed)
        raise TypeError(f"{name} must have dtype {want}; got {t.dtype}")


def ndim(name: str, t: torch.Tensor, n: int, shape_doc: str) -> None:
    if t.ndim != n:
        raise ValueError(f"{name} must be {n}-D {shape_doc}; got shape {tuple(t.shape)}")


def same_device(**tensors: torch.Tensor) -> torch.device:
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name} is on {t.device} but {first_name} is on {first.device}; "
                "all tensors must be on one device"
            )
    return first.device


def int_arg(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def paged_rows(name: str, cache: torch.Tensor, width: int, unit: str) -> tuple[int, int, int]:
    """(num_blocks, block_size, block stride) of a paged cache ``[num_blocks, block_size,
    width]`` with contiguous rows whose block stride is a whole number of rows, at least
    ``block_size`` of them (other layers' rows may sit between blocks); else a ValueError.
    ``unit`` names what ``width`` counts ("byte", "element")."""
    num_blocks, block_size, row = cache.shape
    s0, s1, s2 = cache.stride()
    if row != width or (row > 1 and s2 != 1) or (block_size > 1 and s1 != width):
        raise ValueError(
            f"{name} {tuple(cache.shape)} with strides {cache.stride()} must be "
            f"[num_blocks, block_size, {width}] with contiguous {width}-{unit} rows"
        )
    if num_blocks > 1 and (s0 % width or s0 < block_size * width):
        raise ValueError(
            f"{name} block stride {s0} must be a whole number of {width}-{unit} rows "
            f"and at least block_size * {width} = {block_size * width}"
        )
    return num_blocks, block_size, s0


def table_and_lengths(block_table: torch.Tensor, cache_seqlens: torch.Tensor, batch: int) -> None:
    """The decodes' block table [batch, max_num_blocks_per_seq] and lengths [batch], int32."""
    dtype("block_table", block_table, (torch.int32,))
    ndim("block_table", block_table, 2, "[batch, max_num_blocks_per_seq]")
    dtype("cache_seqlens", cache_seqlens, (torch.int32,))
    ndim("cache_seqlens", cache_seqlens, 1, "[batch]")
    if block_table.shape[0] != batch or cache_seqlens.shape[0] != batch:
        raise ValueError(
            f"block_table {tuple(block_table.shape)} and cache_seqlens "
            f"{tuple(cache_seqlens.shape)} must have q's batch {batch}"
        )
