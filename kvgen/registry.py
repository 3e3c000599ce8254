"""Every variant kvgen can list, generate, verify and tune, by name."""

from __future__ import annotations

import difflib

from kvgen.codegen.spec import VariantSpec
from kvgen.families import mla_decode, mxfp4_mla, per_token_head

_FAMILY_MODULES = (mxfp4_mla, per_token_head, mla_decode)


def variants(arch: str, target: str, family: str | None = None) -> list[VariantSpec]:
    specs = [s for m in _FAMILY_MODULES for s in m.variants(arch, target)]
    if family is not None:
        specs = [s for s in specs if s.family == family]
    return specs


def families() -> list[str]:
    return sorted({s.family for s in variants("sm90", "gpu")})


def lookup(names: list[str], arch: str, target: str) -> list[VariantSpec]:
    """Specs for ``names`` (exact variant names or family names); unknown names raise KeyError."""
    by_name = {s.name: s for s in variants(arch, target)}
    out: list[VariantSpec] = []
    for name in names:
        if name in by_name:
            out.append(by_name[name])
            continue
        fam = [s for s in by_name.values() if s.family == name]
        if fam:
            out.extend(fam)
            continue
        close = difflib.get_close_matches(name, list(by_name) + families(), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise KeyError(f"no variant or family named {name!r} for {arch}/{target}{hint}")
    return out
