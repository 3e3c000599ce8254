"""kvgen's kernels, with the APIs of the vLLM functions they replace.

>>> from kvgen.ops import store_mxfp4_mla

Importing this module needs torch, triton and jinja2 only (never optuna). Kernels are generated
and compiled on first use for each specialisation, then reused.
"""

from kvgen.ops._mxfp4_mla import GROUP_SIZE, gather_mxfp4_mla, mxfp4_row_bytes, store_mxfp4_mla

__all__ = ["GROUP_SIZE", "gather_mxfp4_mla", "mxfp4_row_bytes", "store_mxfp4_mla"]
