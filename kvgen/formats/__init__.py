"""kvgen's cache formats: the format objects (``FORMATS``: one ``KVFormat`` per format, built
from its parts, an ``Element`` and a ``Scale``) and the pure-torch references they call
(``mxfp4``, ``per_token_head``), written from docs/formats.md.

None of this knows about Triton or the kernels: the references are the executable statement
of each format, and the tests compare every generated kernel against them byte for byte.
"""

from kvgen.formats._format import (
    E2M1,
    E4M3,
    E5M2,
    E8M0,
    FORMATS,
    FP8_E4M3,
    FP8_E5M2,
    FP16_SCALE,
    FP32_SCALE,
    INT4,
    INT4_LEVELS,
    INT8,
    INT8_ELEMENT,
    MXFP4,
    OWN_CACHE,
    ROW_TAIL,
    Element,
    KVFormat,
    Scale,
    get,
)

__all__ = [
    "E2M1",
    "E4M3",
    "E5M2",
    "E8M0",
    "FORMATS",
    "FP8_E4M3",
    "FP8_E5M2",
    "FP16_SCALE",
    "FP32_SCALE",
    "INT4",
    "INT4_LEVELS",
    "INT8",
    "INT8_ELEMENT",
    "MXFP4",
    "OWN_CACHE",
    "ROW_TAIL",
    "Element",
    "KVFormat",
    "Scale",
    "get",
]
