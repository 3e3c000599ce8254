"""Every variant kvgen can list, generate, verify and tune, by name."""

from __future__ import annotations

import difflib

from kvgen.codegen.spec import ARCHS, TARGETS, SpecError, VariantSpec
from kvgen.families import mla_decode, mxfp4_mla, per_token_head

_FAMILY_MODULES = (mxfp4_mla, per_token_head, mla_decode)


def variants(arch: str, target: str, family: str | None = None) -> list[VariantSpec]:
    specs = [s for m in _FAMILY_MODULES for s in m.variants(arch, target)]
    if family is not None:
        specs = [s for s in specs if s.family == family]
    return specs


def families() -> list[str]:
    return sorted({s.family for s in variants("sm90", "gpu")})


def spec_class(family: str) -> type[VariantSpec] | None:
    """The spec class of ``family`` (None for a family this kvgen does not know)."""
    return next((type(s) for s in variants("sm90", "gpu") if s.family == family), None)


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
    """The (arch, target) a full variant name ends with (``...-sm90-gpu``), if it does."""
    parts = name.rsplit("-", 2)
    if len(parts) == 3 and parts[1] in ARCHS and parts[2] in TARGETS:
        return parts[1], parts[2]
    return None


def lookup(names: list[str], arch: str, target: str) -> list[VariantSpec]:
    """Specs for ``names`` (variant names, listed or not, or family names); unknown names raise
    KeyError. A variant name is looked up with the arch and target it spells; ``arch`` and
    ``target`` pick the variants of family names."""
    out: list[VariantSpec] = []
    for name in names:
        where = _spelled_target(name) or (arch, target)
        listed = variants(*where)
        by_name = {s.name: s for s in listed}
        if name in by_name:
            out.append(by_name[name])
            continue
        fam = [s for s in listed if s.family == name]
        if fam:
            out.extend(fam)
            continue
        spec = _unlisted(name, listed)
        if isinstance(spec, VariantSpec):
            out.append(spec)
            continue
        close = difflib.get_close_matches(name, list(by_name) + families(), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        why = f" ({spec})" if isinstance(spec, str) else ""
        raise KeyError(f"no variant or family named {name!r} for {where[0]}/{where[1]}{why}{hint}")
    return out
