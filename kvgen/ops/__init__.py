"""kvgen's kernels, with the APIs of the vLLM functions they replace.

>>> from kvgen.ops import store_mxfp4_mla

Importing this module needs torch, triton and jinja2 only (never optuna). Kernels are generated
and compiled on first use for each specialisation, then reused.
"""

from kvgen.ops._gqa_decode import flash_attn_with_kvcache
from kvgen.ops._mla_cache import concat_and_cache_mla, gather_mla_cache
from kvgen.ops._mla_decode import flash_mla_with_kvcache
from kvgen.ops._mla_metadata import MLASchedMeta, get_mla_metadata
from kvgen.ops._mxfp4_mla import GROUP_SIZE, gather_mxfp4_mla, mxfp4_row_bytes, store_mxfp4_mla
from kvgen.ops._per_token_head import (
    gather_kv_per_token_head,
    triton_reshape_and_cache_flash_int4_per_token_head,
    triton_reshape_and_cache_flash_per_token_head_quant,
)

# Shorter names for the two vLLM seed ops.
store_kv_per_token_head = triton_reshape_and_cache_flash_per_token_head_quant
store_kv_int4_per_token_head = triton_reshape_and_cache_flash_int4_per_token_head

__all__ = [
    "GROUP_SIZE",
    "concat_and_cache_mla",
    "flash_attn_with_kvcache",
    "flash_mla_with_kvcache",
    "gather_kv_per_token_head",
    "gather_mla_cache",
    "gather_mxfp4_mla",
    "get_mla_metadata",
    "MLASchedMeta",
    "mxfp4_row_bytes",
    "store_kv_int4_per_token_head",
    "store_kv_per_token_head",
    "store_mxfp4_mla",
    "triton_reshape_and_cache_flash_int4_per_token_head",
    "triton_reshape_and_cache_flash_per_token_head_quant",
]
