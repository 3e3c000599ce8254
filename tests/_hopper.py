"""What the decode tests share: block tables made unreadable, and the Hopper (Gluon) variants."""

import pytest

# How spoil_table makes sequence 1 unreadable (the parameter of the bad-block-table tests)
BAD_TABLES = ("page_past_end", "negative_page", "longer_than_table")


def spoil_table(table, seqlens, bad, num_blocks, page):
    """Copies of ``table`` and ``seqlens`` in which sequence 1 names a page past the cache's
    ``num_blocks`` ("page_past_end"), a negative page ("negative_page"), or is longer than its
    table row of ``page``-key pages holds ("longer_than_table")."""
    table, seqlens = table.clone(), seqlens.clone()
    if bad == "page_past_end":
        table[1, 1] = num_blocks + 99
    elif bad == "negative_page":
        table[1, 0] = -1
    else:
        seqlens[1] = table.shape[1] * page + 5
    return table, seqlens


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
