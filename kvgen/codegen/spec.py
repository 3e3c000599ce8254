"""Frozen variant specs: every specialisation parameter of a kernel, and the name built from them.

A spec is the single source of a variant's identity (the FlashInfer habit): its name is the
module name, the cache file name, the key in tuned_configs JSON and what ``kvgen list`` prints.
Every field is an *axis* that declares the values it may take; a spec validates itself when it is
built, so nothing but known values ever reaches a template.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

_AXIS = "kvgen_axis"

ARCHS = ("sm80", "sm89", "sm90", "sm100")
TARGETS = ("gpu", "interp")


class SpecError(ValueError):
    """A spec field holds a value its axis does not allow."""


@dataclasses.dataclass(frozen=True)
class _Axis:
    tag: str  # prefix in the variant name: "g" + 32 -> "g32"; "" for self-describing values
    choices: tuple[Any, ...] | None
    check: Callable[[Any], bool] | None
    doc: str

    def allows(self, value: Any) -> bool:
        if self.choices is not None:
            return value in self.choices and type(value) is type(self.choices[0])
        assert self.check is not None
        return self.check(value)

    def describe(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        return self.doc


def axis(
    tag: str,
    *,
    choices: Iterable[Any] | None = None,
    check: Callable[[Any], bool] | None = None,
    doc: str = "",
    default: Any = dataclasses.MISSING,
) -> Any:
    """Declare a spec field: its name tag and the values it may take (``choices`` or ``check``)."""
    if (choices is None) == (check is None):
        raise TypeError("an axis takes exactly one of choices= or check=")
    meta = _Axis(tag, tuple(choices) if choices is not None else None, check, doc)
    return dataclasses.field(default=default, metadata={_AXIS: meta})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(limit: int) -> Callable[[Any], bool]:
    return lambda v: _is_int(v) and 0 < v <= limit


@dataclasses.dataclass(frozen=True)
class VariantSpec:
    """Base of every kernel family's spec. Subclasses set ``family`` and, unless it is
    ``<family>.py.j2`` in kvgen's ``templates/``, ``template``."""

    family: ClassVar[str]
    template: ClassVar[str]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "family" in cls.__dict__ and not hasattr(cls, "template"):
            cls.template = f"{cls.family}.py.j2"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            ax: _Axis = f.metadata[_AXIS]
            value = getattr(self, f.name)
            if not ax.allows(value):
                raise SpecError(
                    f"{self.family}: {f.name}={value!r} is not allowed; expected {ax.describe()}"
                )
        self.check_combination()

    def check_combination(self) -> None:
        """Constraints between fields (e.g. group divides latent). Raise SpecError."""

    @classmethod
    def axes(cls) -> dict[str, _Axis]:
        return {f.name: f.metadata[_AXIS] for f in dataclasses.fields(cls)}

    @property
    def name(self) -> str:
        parts = [self.family]
        for f in dataclasses.fields(self):
            parts.append(f"{f.metadata[_AXIS].tag}{getattr(self, f.name)}")
        return "-".join(parts)

    @classmethod
    def from_name(cls, name: str) -> VariantSpec:
        """The spec whose ``name`` is ``name`` (any allowed field values, listed or not).

        Raises SpecError when ``name`` is not this family's, a part lacks its field's tag, or a
        value is not allowed.
        """
        parts = name.split("-")
        fields = dataclasses.fields(cls)
        if parts[0] != cls.family or len(parts) != len(fields) + 1:
            raise SpecError(f"{name!r} is not a {cls.family} variant name")
        values = {}
        for f, part in zip(fields, parts[1:], strict=True):
            tag = f.metadata[_AXIS].tag
            if not part.startswith(tag) or part == tag:
                raise SpecError(f"{name!r}: expected {f.name} as {tag}<value>, got {part!r}")
            text = part[len(tag) :]
            if f.type in ("int", int):
                if not text.isdigit():
                    raise SpecError(f"{name!r}: {f.name} must be an integer, got {text!r}")
                values[f.name] = int(text)
            else:
                values[f.name] = text
        spec = cls(**values)
        if spec.name != name:  # e.g. a leading zero
            raise SpecError(f"{name!r} is not a canonical variant name (did you mean {spec.name}?)")
        return spec

    @property
    def module_name(self) -> str:
        return "kvgen_gen_" + self.name.replace("-", "_")

    def fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def derived(self) -> dict[str, Any]:
        """Values computed from the fields that the template needs (padded widths, ...)."""
        return {}

    def context(self) -> dict[str, Any]:
        ctx = {"spec": self, "name": self.name, "family": self.family}
        ctx.update(self.fields())
        ctx.update(self.derived())
        return ctx
