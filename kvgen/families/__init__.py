"""Kernel families: each folder holds its spec classes (axes, names, defaults, variants), the
``Family`` objects the registry lists, and how a variant is verified and tuned."""

from kvgen.families._base import Family, Problem

__all__ = ["Family", "Problem"]
