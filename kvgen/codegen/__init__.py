"""The generator: frozen specs, Jinja rendering, and the on-disk module cache."""

from kvgen.codegen.render import cache_root, load, render, template_hash, write_source
from kvgen.codegen.spec import SpecError, VariantSpec, axis

__all__ = [
    "SpecError",
    "VariantSpec",
    "axis",
    "cache_root",
    "load",
    "render",
    "template_hash",
    "write_source",
]
