"""What the decode tests share about the Hopper (Gluon) variants."""

import pytest

# Lengths around every tile and page edge (tiles of 16-64 keys), and a long one.
MANY_LENGTHS = [1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 0, 127, 128, 129, 200, 257, 700]


def hopper(specs, variant="wgmma"):
    """The specs of ``specs`` of the Hopper (Gluon) ``variant``; on a machine without an sm90
    GPU, one skipped case saying why (Gluon does not run in Triton's interpreter)."""
    found = [s for s in specs if s.variant == variant]
    return found or [
        pytest.param(
            None, marks=pytest.mark.skip(reason=f"{variant}: an sm90 GPU only"), id=variant
        )
    ]


def tuned_doc(family: str, entries: dict) -> dict:
    """A tuned-configs file of ``family`` for sm90 holding ``entries`` (what the ops' variant
    choice reads), with this process's torch and Triton (the loader ignores another's)."""
    import torch
    import triton

    return {
        "schema_version": 1,
        "family": family,
        "env": {"arch": "sm90", "cuda": "x", "device": "x", "kvgen": "x",
                "torch": torch.__version__, "triton": triton.__version__},
        "provenance": {"date": "x", "sampler": "tpe", "trials": 1},
        "entries": entries,
    }  # fmt: skip
