"""What the property-based (hypothesis) tests of the ops share: how many examples, the settings,
generated slot mappings, and byte-exact snapshots of caches."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# A bounded number of generated calls a test (each runs kernels under the interpreter on a CPU);
# KVGEN_FUZZ_EXAMPLES raises it on a GPU.
EXAMPLES = int(os.environ.get("KVGEN_FUZZ_EXAMPLES", "30"))

fuzz = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

SLOT_KINDS = ("valid", "valid", "negative", "past_end", "int64", "short", "float")


def slots(draw, n: int, num_slots: int, gen, kinds=SLOT_KINDS) -> tuple[torch.Tensor, str]:
    """(slot_mapping, its kind): ``n`` distinct slots of ``num_slots``, then one of ``kinds``:
    a negative slot, one past the end, int64, one entry too few, or float (wrong dtype)."""
    out = torch.randperm(num_slots, generator=gen)[:n]
    kind = draw(st.sampled_from(kinds))
    if kind == "negative" and n:
        out[0] = -1
    elif kind == "past_end" and n:
        out[-1] = num_slots + 2
    elif kind == "short" and n:
        out = out[:-1]
    if kind == "float":
        return out.float(), kind
    return out.to(torch.int64 if kind == "int64" else torch.int32), kind


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def snapshot(ts) -> list[torch.Tensor]:
    """Each tensor's elements as integers of its width (any strides; NaNs compare equal)."""
    return [t.view(_BITS[t.element_size()]).clone() for t in ts if t is not None]


def block_table(seqlens: list[int], page: int, bad_page, short_table: bool, gen):
    """A random block table for ``seqlens`` over just enough pages: (int32 table, num_blocks,
    invalid). ``bad_page`` (unless None) replaces sequence 0's first entry; ``short_table`` cuts
    the rows one entry short of the last sequence's need. ``invalid``: the sequences that then
    need a page outside the cache or past their row (a decode gives NaN for them)."""
    need = [-(-n // page) for n in seqlens]
    blocks = max(sum(need), 1)
    width = max(max(need), 1)
    table = torch.randint(0, blocks, (len(seqlens), width), generator=gen, dtype=torch.int32)
    invalid = set()
    if bad_page is not None and need[0] > 0:
        table[0, 0] = bad_page
        invalid.add(0)
    if short_table and need[-1] > 1:
        table = table[:, : need[-1] - 1]  # the last sequence is longer than its row
        invalid |= {b for b, n in enumerate(need) if n > table.shape[1]}
    return table, blocks, invalid


def check_invalid(out, lse, sl: torch.Tensor, invalid: set[int]):
    """Assert that the ``invalid`` sequences' out and lse are all NaN; return the other
    sequences' indices and the lengths a reference reads (0 for the invalid ones)."""
    for b in invalid:
        assert torch.isnan(lse[b]).all() and torch.isnan(out[b].float()).all()
    keep = [b for b in range(sl.shape[0]) if b not in invalid]
    ref_sl = sl.clone()
    ref_sl[sorted(invalid)] = 0  # (the reference reads only what the table holds)
    return keep, ref_sl
