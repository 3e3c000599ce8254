"""kvgen: code-generated, autotuned Triton kernels for quantized paged KV caches.

The public surface is :mod:`kvgen.ops` (the kernels, with the APIs of the vLLM functions they
replace) and the ``kvgen`` command line. Everything whose name starts with an underscore is
private.
"""

import logging as _logging
import os as _os

__version__ = "0.1.0"

__all__ = ["__version__"]

# KVGEN_LOG=debug|info|warning: print kvgen's log records to stderr at that level (at debug,
# one line per specialisation and bucket says which tuned config, or which defaults, a call
# used). Without it kvgen logs through the "kvgen" logger as any library does.
if _os.environ.get("KVGEN_LOG"):
    _level = _logging.getLevelName(_os.environ["KVGEN_LOG"].upper())
    if isinstance(_level, int):
        _handler = _logging.StreamHandler()
        _handler.setFormatter(_logging.Formatter("%(levelname)s %(message)s"))
        _logger = _logging.getLogger("kvgen")
        _logger.addHandler(_handler)
        _logger.setLevel(_level)
