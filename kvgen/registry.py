"""Every kernel family and variant kvgen can list, generate, verify and tune, by name.

Families come from kvgen's own packages (``BUILTIN``), from the ``kvgen.families`` entry point
group (each entry a ``Family`` instance or class, so a family defined in another package works
the same way) and from ``register`` at run time.
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib
import importlib.metadata
import logging
from functools import cache

from kvgen.codegen.spec import ARCHS, TARGETS, SpecError, VariantSpec
from kvgen.families._base import Family

log = logging.getLogger("kvgen")

# kvgen's own families: modules whose FAMILIES tuple lists them
BUILTIN = (
    "kvgen.families.mxfp4_mla.family",
    "kvgen.families.per_token_head.family",
    "kvgen.families.mla_decode.family",
    "kvgen.families.mla_cache.family",
    "kvgen.families.gqa_decode.family",
)
ENTRY_POINTS = "kvgen.families"
_registered: dict[str, Family] = {}


@cache
def _discovered() -> tuple[Family, ...]:
    found: list[Family] = []
    for module in BUILTIN:
        found.extend(importlib.import_module(module).FAMILIES)
    for entry in importlib.metadata.entry_points(group=ENTRY_POINTS):
        try:
            obj = entry.load()
            found.append(obj() if isinstance(obj, type) else obj)
        except Exception as exc:  # a broken plug-in must not take kvgen down with it
            log.warning("kvgen: cannot load family %r from %s: %s", entry.name, entry.value, exc)
    return tuple(found)


def all_families() -> dict[str, Family]:
    """name -> family, every family this process knows."""
    out: dict[str, Family] = {}
    for fam in (*_discovered(), *_registered.values()):
        if not isinstance(fam, Family):
            raise TypeError(f"{fam!r} is not a kvgen.families.Family")
        out.setdefault(fam.name, fam)
    return out


def register(family: Family) -> Family:
    """Add a family defined outside kvgen (instead of an entry point); returns it."""
    if not isinstance(family, Family):
        raise TypeError(f"{family!r} is not a kvgen.families.Family")
    if family.name in all_families() and all_families()[family.name] is not family:
        raise ValueError(f"a family named {family.name!r} is already registered")
    _registered[family.name] = family
    return family


def unregister(name: str) -> None:
    _registered.pop(name, None)


def _family(name: str) -> Family:
    fams = all_families()
    if name not in fams:
        raise KeyError(f"unknown family {name!r}; known: {', '.join(sorted(fams))}")
    return fams[name]


family = _family  # the family named ``name``; KeyError for an unknown one


def variants(arch: str, target: str, family: str | None = None) -> list[VariantSpec]:
    fams = all_families().values() if family is None else [_family(family)]
    return [s for f in fams for s in f.variants(arch, target)]


def families() -> list[str]:
    return sorted(all_families())


def spec_class(name: str) -> type[VariantSpec] | None:
    """The spec class of family ``name`` (None for a family this kvgen does not know)."""
    fam = all_families().get(name)
    return fam.spec_class if fam is not None else None


def default_tuned(arch: str) -> list[VariantSpec]:
    """What ``kvgen tune`` tunes when no names are given: each family's choice."""
    return [s for f in all_families().values() for s in f.default_tuned(arch)]


def _unlisted(name: str, listed: list[VariantSpec]) -> VariantSpec | str | None:
    """The spec that ``name`` spells in a listed variant's family, if its choice-valued fields
    (dtype, variant, arch, target, ...) are those of a listed variant: sizes outside the default
    lists (other head sizes) generate on demand. A string says why a name of a listed family is
    not a variant; None: no listed family's name."""
    for cls in {type(s) for s in listed}:
        if not name.startswith(cls.family + "-"):
            continue
        try:
            spec = cls.from_name(name)
        except SpecError as exc:
            return str(exc)
        chosen = [n for n, ax in cls.axes().items() if ax.choices is not None]
        key = [getattr(spec, n) for n in chosen]
        if any(type(s) is cls and [getattr(s, n) for n in chosen] == key for s in listed):
            return spec
        return None
    return None


def _spelled_target(name: str) -> tuple[str, str] | None:
    """The (arch, target) a full variant name spells (``...-sm90-gpu``, or followed by the
    fields a subclass spec adds, ``...-sm90-gpu-g32``), if it does."""
    parts = name.split("-")
    for arch, target in zip(parts[-2::-1], parts[:0:-1], strict=True):
        if arch in ARCHS and target in TARGETS:
            return arch, target
    return None


WILDCARDS = "*?["  # a name holding one of these is a shell-style pattern (fnmatch)


def lookup(names: list[str], arch: str, target: str) -> list[VariantSpec]:
    """Specs for ``names`` (variant names, listed or not, family names, or shell-style patterns
    of listed variant names such as ``gqa_decode-*-rows-*``), each spec once, in the order the
    names give them; unknown names, and patterns that match no listed variant, raise KeyError.
    A variant name is looked up with the arch and target it spells; ``arch`` and ``target``
    pick the variants of family names and patterns."""
    out: list[VariantSpec] = []

    def add(specs) -> None:
        out.extend(s for s in specs if s not in out)

    for name in names:
        if any(c in name for c in WILDCARDS):
            listed = variants(arch, target)
            matched = [s for s in listed if fnmatch.fnmatchcase(s.name, name)]
            if not matched:
                fams = sorted({s.family for s in listed})
                raise KeyError(
                    f"no variant for {arch}/{target} matches {name!r} (a pattern of variant "
                    f"names, as kvgen list prints them; families: {', '.join(fams)})"
                )
            add(matched)
            continue
        where = _spelled_target(name) or (arch, target)
        listed = variants(*where)
        by_name = {s.name: s for s in listed}
        if name in by_name:
            add([by_name[name]])
            continue
        fam = [s for s in listed if s.family == name]
        if fam:
            add(fam)
            continue
        spec = _unlisted(name, listed)
        if isinstance(spec, VariantSpec):
            add([spec])
            continue
        close = difflib.get_close_matches(name, list(by_name) + families(), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        why = f" ({spec})" if isinstance(spec, str) else ""
        raise KeyError(f"no variant or family named {name!r} for {where[0]}/{where[1]}{why}{hint}")
    return out
