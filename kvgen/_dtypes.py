"""The one table of dtype names: the short names in variant names and messages, the torch
dtypes, and the source names the templates write (``torch.bfloat16``, ``gl.bfloat16``)."""

import torch

from kvgen import formats

# the input / output float dtypes of the kernels, by the short name variant names use
TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# cache code dtypes, by the format name variant names use (int4 codes are packed into uint8)
CACHE = {
    f.name: f.code_dtype for f in (formats.INT8, formats.FP8_E4M3, formats.FP8_E5M2, formats.INT4)
}
# short name of every dtype kvgen handles (variant names, error messages)
NAME = {
    **{v: k for k, v in TORCH.items()},
    **{v: k for k, v in CACHE.items() if k != "int4"},
    torch.uint8: "uint8",
    torch.int32: "int32",
    torch.int64: "int64",
}
# short name -> the dtype's name in generated source (torch.<name>, tl / gl.<name>)
SOURCE = {k: str(v).removeprefix("torch.") for k, v in TORCH.items()}
