"""What ``kvgen tune`` tunes: the (variant, search space, bucket) studies of a run.

By default each family's own choice of variants (``Family.default_tuned``: the ones the
benchmarks measure) at the buckets it tunes by default (``Family.tuned_by_default``); named
variants or families otherwise, at every bucket. Every bucket of a variant's search space that
its family says applies, narrowed by the ``--buckets`` / ``--heads`` / ``--where`` filters.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvgen import registry
from kvgen.codegen.spec import VariantSpec
from kvgen.space import Space, load_space


@dataclasses.dataclass(frozen=True)
class Study:
    spec: VariantSpec
    space: Space
    bucket: dict[str, Any]


def plan(
    names: list[str] | None,
    arch: str,
    *,
    families: set[str] | None = None,
    num_tokens: set[int] | None = None,
    num_heads: set[int] | None = None,
    where: dict[str, set[int]] | None = None,
) -> list[Study]:
    """The studies of a tuning run on ``arch`` (GPU target). Unknown names raise KeyError.
    ``where``: only buckets that have each of its sizes at one of its values (a bucket without
    that size is left out)."""
    if names:
        specs = registry.lookup(names, arch, "gpu")
    else:
        specs = registry.default_tuned(arch)
    specs = [s for s in specs if registry.family(s.family).tunable]
    if families:
        specs = [s for s in specs if s.family in families]
    out = []
    for spec in specs:
        fam = registry.family(spec.family)
        space = load_space(spec.template)
        for bucket in space.bucket_list():
            if num_tokens and "num_tokens" in bucket and bucket["num_tokens"] not in num_tokens:
                continue
            if num_heads and "num_heads" in bucket and bucket["num_heads"] not in num_heads:
                continue
            if where and any(bucket.get(k) not in vals for k, vals in where.items()):
                continue
            if fam.bucket_applies(spec, bucket) and (names or fam.tuned_by_default(spec, bucket)):
                out.append(Study(spec, space, bucket))
    return out
