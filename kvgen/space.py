"""Search spaces declared next to each template (``templates/<template>.space.toml``).

A space names the meta-parameters and their values, the shape buckets a tuned config is keyed
by, and static constraints: expressions over the spec's fields and derived values, the
parameters and the arch's limits, checked before anything is compiled. The expression language
is a small, safe subset of Python (arithmetic, comparisons, ``and``/``or``/``not``, and the
functions below); nothing else is evaluated.
"""

from __future__ import annotations

import ast
import itertools
import math
import tomllib
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from kvgen._math import cdiv

# Per-arch limits the constraints may use.
ARCH_LIMITS = {
    "sm80": {"max_threads": 1024, "smem_bytes": 166912, "registers_per_thread": 255},
    "sm89": {"max_threads": 1024, "smem_bytes": 101376, "registers_per_thread": 255},
    "sm90": {"max_threads": 1024, "smem_bytes": 232448, "registers_per_thread": 255},
    "sm100": {"max_threads": 1024, "smem_bytes": 232448, "registers_per_thread": 255},
}

_FUNCS = {
    "is_pow2": lambda n: n > 0 and n & (n - 1) == 0,
    "min": min,
    "max": max,
    "cdiv": cdiv,
    "log2": math.log2,
}
_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
    ast.Pow: lambda a, b: a**b,
}
_CMPOPS = {
    ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b,
    ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b,
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
}


class SpaceError(ValueError):
    """A malformed space file or constraint."""


def evaluate(expr: str, names: dict[str, Any]) -> Any:
    """Evaluate a constraint expression with only ``names`` and a few functions in scope."""

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, bool)):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in names:
                raise SpaceError(f"unknown name {node.id!r} in constraint {expr!r}")
            return names[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else not v
        if isinstance(node, ast.BoolOp):
            values = [ev(v) for v in node.values]
            return all(values) if isinstance(node.op, ast.And) else any(values)
        if isinstance(node, ast.Compare):
            left = ev(node.left)
            for op, right_node in zip(node.ops, node.comparators, strict=True):
                if type(op) not in _CMPOPS:
                    raise SpaceError(f"operator not allowed in constraint {expr!r}")
                right = ev(right_node)
                if not _CMPOPS[type(op)](left, right):
                    return False
                left = right
            return True
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCS
            and not node.keywords
        ):
            return _FUNCS[node.func.id](*[ev(a) for a in node.args])
        raise SpaceError(f"{ast.dump(node)[:60]} is not allowed in constraint {expr!r}")

    return ev(_parse(expr))


@cache
def _parse(expr: str) -> ast.Expression:
    """``expr``'s syntax tree, parsed once (a tuner evaluates each constraint at every point of
    a space, for every study: parsing was most of that time)."""
    try:
        return ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise SpaceError(f"constraint {expr!r} is not an expression: {exc}") from None


@dataclass(frozen=True)
class Space:
    template: str
    params: dict[str, tuple]
    buckets: dict[str, tuple[int, ...]]
    constraints: dict[str, str]
    # Constraints that also name the bucket's sizes (e.g. no more heads per program than the
    # bucket has heads): checked when a study of a bucket proposes a point.
    bucket_constraints: dict[str, str] = field(default_factory=dict)
    # Parameters that only the host code reads (a split policy): points that differ in them
    # alone run the same compiled kernels ([host] params = [...] in the space file).
    host: tuple[str, ...] = ()
    # Bucket sizes the kernels are compiled for (a constexpr comes from them): each value of
    # these compiles binaries of its own ([compile] per_bucket = [...] in the space file).
    per_bucket: tuple[str, ...] = ()
    # Constraints that name a call's sizes and that the kernel needs to run at all (e.g. the
    # pages in flight the kernel for that many rows takes): checked as bucket constraints
    # when a study proposes a point, and by ``kvgen.configs`` when a tuned entry of another
    # bucket would serve a call ([call_constraints] in the space file).
    call_constraints: dict[str, str] = field(default_factory=dict)
    # feasible()'s answers, by (spec, bucket): every study asks several times
    _feasible: dict = field(default_factory=dict, compare=False, repr=False)

    def points(self) -> list[dict[str, Any]]:
        """Every combination of parameter values (the exhaustive grid)."""
        keys = list(self.params)
        return [
            dict(zip(keys, vals, strict=True)) for vals in itertools.product(*self.params.values())
        ]

    def bucket_list(self) -> list[dict[str, int]]:
        keys = list(self.buckets)
        return [
            dict(zip(keys, vals, strict=True)) for vals in itertools.product(*self.buckets.values())
        ]

    def violations(
        self, spec, meta: dict[str, Any], bucket: dict[str, int] | None = None
    ) -> list[str]:
        """Names of the constraints ``meta`` breaks for ``spec`` (empty: it may be compiled),
        and with ``bucket`` also the bucket constraints (empty: it is worth timing there)."""
        return self._broken(self._names(spec), meta, bucket)

    def call_violations(self, spec, meta: dict[str, Any], sizes: dict[str, int]) -> list[str]:
        """Names of the call constraints ``meta`` breaks at a call of ``sizes`` (where an
        entry tuned at another bucket would be used)."""
        names = {**self._names(spec), **meta, **sizes}
        return [n for n, expr in self.call_constraints.items() if not evaluate(expr, names)]

    def _names(self, spec) -> dict[str, Any]:
        """What a constraint may name besides the parameters and the bucket's sizes."""
        return {**spec.fields(), **spec.derived(), **ARCH_LIMITS[spec.arch]}

    def _broken(self, base: dict[str, Any], meta, bucket) -> list[str]:
        names = {**base, **meta}
        checks = dict(self.constraints)
        if bucket is not None:
            names.update(bucket)
            checks.update(self.bucket_constraints)
            checks.update(self.call_constraints)
        return [name for name, expr in checks.items() if not evaluate(expr, names)]

    def feasible(self, spec, bucket: dict[str, int] | None = None) -> list[dict[str, Any]]:
        """The grid points that break no constraint for ``spec`` (and ``bucket``)."""
        key = (spec, None if bucket is None else tuple(sorted(bucket.items())))
        if key not in self._feasible:
            base = self._names(spec)
            self._feasible[key] = [m for m in self.points() if not self._broken(base, m, bucket)]
        return [dict(m) for m in self._feasible[key]]

    def compile_points(self, spec) -> list[dict[str, Any]]:
        """The feasible points, one for each set of compiled kernels: the first of those that
        differ only in host parameters."""
        seen, out = set(), []
        for m in self.feasible(spec):
            key = self.compile_key(m)
            if key not in seen:
                seen.add(key)
                out.append(m)
        return out

    def compile_key(self, meta: dict[str, Any]) -> tuple:
        """What ``meta``'s compiled kernels depend on: its values but the host parameters'."""
        return tuple(v for k, v in meta.items() if k not in self.host)

    def steps(self, a: dict[str, Any], b: dict[str, Any]) -> int:
        """How many one-value steps along the parameters' ordered values lead from ``a`` to
        ``b`` (4 -> 8 warps is one step, 2 -> 8 two): the local search's distance."""
        return sum(
            abs(values.index(a[k]) - values.index(b[k])) for k, values in self.params.items()
        )

    def compile_rings(
        self, spec, seeds: list[dict[str, Any]], radius: int
    ) -> list[list[dict[str, Any]]]:
        """``compile_points`` within ``radius`` steps of the nearest of ``seeds`` (a search's
        start points), grouped by that distance: ring r holds those r steps away. A compile
        serves every point that differs from it in host parameters alone, so it sits in the
        ring of the nearest such point. Seeds outside the space are ignored."""
        seeds = [s for s in seeds if self.allows(s)]
        rings: list[list[dict[str, Any]]] = [[] for _ in range(radius + 1)]
        if not seeds:
            return rings
        nearest: dict[tuple, tuple[int, dict[str, Any]]] = {}
        for m in self.feasible(spec):
            d = min(self.steps(m, s) for s in seeds)
            key = self.compile_key(m)
            if d <= radius and (key not in nearest or d < nearest[key][0]):
                nearest[key] = (d, m)
        for d, m in nearest.values():
            rings[d].append(m)
        return rings

    def allows(self, meta: dict[str, Any]) -> bool:
        """Whether ``meta`` names exactly this space's parameters, with values from the space."""
        return set(meta) == set(self.params) and all(meta[k] in self.params[k] for k in self.params)


def bucket_key(bucket: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in bucket.items())


def parse_bucket_key(key: str) -> dict[str, int]:
    out = {}
    for part in key.split(","):
        name, _, value = part.partition("=")
        out[name] = int(value)
    return out


@cache
def load_space(template: str) -> Space:
    from kvgen.codegen.render import template_path

    path = template_path(template)
    path = path.with_name(path.name.replace(".py.j2", ".space.toml"))
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SpaceError(f"cannot read the search space {path}: {exc}") from None
    try:
        params = {k: tuple(v) for k, v in doc["params"].items()}
        buckets = {k: tuple(int(x) for x in v) for k, v in doc["buckets"].items()}
        constraints = dict(doc.get("constraints", {}))
        bucket_constraints = dict(doc.get("bucket_constraints", {}))
        call_constraints = dict(doc.get("call_constraints", {}))
        host = tuple(doc.get("host", {}).get("params", ()))
        per_bucket = tuple(doc.get("compile", {}).get("per_bucket", ()))
    except (KeyError, TypeError, AttributeError) as exc:
        raise SpaceError(f"{path}: needs [params] and [buckets] tables ({exc})") from None
    if not params or any(not v for v in params.values()):
        raise SpaceError(f"{path}: every parameter needs at least one value")
    if unknown := [h for h in host if h not in params]:
        raise SpaceError(f"{path}: [host] names {unknown}, which are not parameters")
    if unknown := [b for b in per_bucket if b not in buckets]:
        raise SpaceError(f"{path}: [compile] per_bucket names {unknown}, which are not buckets")
    return Space(template, params, buckets, constraints, bucket_constraints, host, per_bucket,
                 call_constraints)  # fmt: skip
