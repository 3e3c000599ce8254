"""kvgen: code-generated, autotuned Triton kernels for quantized paged KV caches.

The public surface is :mod:`kvgen.ops` (the kernels, with the APIs of the vLLM functions they
replace) and the ``kvgen`` command line. Everything whose name starts with an underscore is
private.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
