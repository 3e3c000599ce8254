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
