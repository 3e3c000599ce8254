"""The interface every kernel family provides, and the only way the rest of kvgen reaches one.

The registry lists families (kvgen's own, those of the ``kvgen.families`` entry point group,
and those registered at run time); ``kvgen list / gen / verify / tune / bench / show`` and the
tests consume them through this class alone, without knowing which family they hold.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from kvgen.codegen.spec import VariantSpec

if TYPE_CHECKING:
    import torch

    from kvgen.bench.run import Bench
    from kvgen.verify import Result

# A tuning problem: ``run(i, meta)`` launches the candidate on rotated input set ``i`` (what is
# timed, inside a CUDA graph), ``check(meta) -> bool`` runs it on fresh inputs against the
# reference, and the number of rotated sets.
Problem = tuple[Callable[[int, dict[str, int]], None], Callable[[dict[str, int]], bool], int]


class Family(abc.ABC):
    """One kernel family: its spec class (the axes, the name, the template, the defaults), its
    variant listing, how ``kvgen verify`` checks a variant, what a tuning trial runs, which
    variants ``kvgen tune`` tunes by default and which buckets apply to a variant.

    The search space sits beside the template (``<template>.space.toml``) and the reference of
    the format in ``kvgen/formats/``; a family outside the package gives its spec class's
    ``template`` as an absolute path, with the space beside it.
    """

    #: the spec class; its ``family`` attribute is the family's name
    spec_class: ClassVar[type[VariantSpec]]

    @property
    def name(self) -> str:
        return self.spec_class.family

    @abc.abstractmethod
    def variants(self, arch: str, target: str) -> list[VariantSpec]:
        """The variants ``kvgen list`` names for this arch and target (other sizes the axes
        allow generate on demand, by name)."""

    @abc.abstractmethod
    def verify(self, spec: VariantSpec, device: torch.device | str) -> Result:
        """Run ``spec``'s kernel on ``device`` against the reference, on inputs that reach the
        format's corners and that the variant's launcher accepts."""

    def tuning_problem(
        self, spec: VariantSpec, bucket: dict[str, int], device: torch.device
    ) -> Problem:
        """What a trial of ``spec`` at ``bucket`` runs on the GPU (``Problem``)."""
        raise NotImplementedError(f"{self.name} has no tuning problem")

    @property
    def tunable(self) -> bool:
        return type(self).tuning_problem is not Family.tuning_problem

    def default_tuned(self, arch: str) -> list[VariantSpec]:
        """The variants ``kvgen tune`` tunes when no names are given (the ones the benchmarks
        measure); none by default."""
        return []

    #: the op labels ``kvgen bench --ops`` takes for this family, and those it times by default
    bench_ops: ClassVar[tuple[str, ...]] = ()
    bench_default: ClassVar[tuple[str, ...]] | None = None  # None: all of bench_ops

    def bench(self, op: str, bench: Bench) -> tuple[str, list]:
        """Time ``op`` (one of ``bench_ops``) on the GPU: ``(section, rows)``, the rows going to
        the bench document's ``section`` ("results" for stores and readers, "decode")."""
        raise NotImplementedError(f"{self.name} has no benchmark")

    def bucket_applies(self, spec: VariantSpec, bucket: dict[str, int]) -> bool:
        """Whether tuning ``spec`` at ``bucket`` means anything (e.g. a head count the shape
        cannot have)."""
        return True

    def tuned_by_default(self, spec: VariantSpec, bucket: dict[str, int]) -> bool:
        """Whether ``kvgen tune`` without names tunes ``spec`` at ``bucket`` (named, every
        bucket that applies is tuned): e.g. not where the op takes another variant it offers
        on ``spec``'s arch, which is faster there by design and tuned in the same run."""
        return True

    def __repr__(self) -> str:
        return f"<kvgen family {self.name}>"
