"""A complete kernel family defined outside kvgen, as a user's package would: its spec, one tiny
template (``toy_scale.py.j2``) and search space beside it, its reference, its check and its
tuning problem. tests/test_family_plugin.py registers it through the ``kvgen.families`` entry
point and through ``kvgen.registry.register``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

import torch

from kvgen.codegen import load
from kvgen.codegen.spec import ARCHS, TARGETS, VariantSpec, axis
from kvgen.families import Family
from kvgen.verify import Result


@dataclasses.dataclass(frozen=True)
class ToyScaleSpec(VariantSpec):
    """out = x * 2, rows of ``width`` fp32 values."""

    family: ClassVar[str] = "toy_scale"
    template: ClassVar[str] = str(Path(__file__).with_name("toy_scale.py.j2"))

    width: int = axis("w", choices=(16, 32), default=16)
    arch: str = axis("", choices=ARCHS, default="sm90")
    target: str = axis("", choices=TARGETS, default="gpu")

    def default_meta(self, num_tokens: int) -> dict[str, int]:
        return {"rows_per_program": 1, "num_warps": 1}


def reference(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class ToyScale(Family):
    spec_class = ToyScaleSpec

    def variants(self, arch, target):
        return [ToyScaleSpec(w, arch, target) for w in (16, 32)]

    def default_tuned(self, arch):
        return self.variants(arch, "gpu")

    def verify(self, spec, device):
        x = torch.randn(5, spec.width, device=device)
        out = torch.full_like(x, float("nan"))
        load(spec).launch(x, out, **spec.default_meta(num_tokens=5))
        bad = int((out.cpu() != reference(x.cpu())).sum())
        return Result(spec.name, bad == 0, bad, float((out - reference(x)).abs().max()))

    def tuning_problem(self, spec, bucket, device):
        xs = [torch.randn(bucket["num_tokens"], spec.width, device=device) for _ in range(2)]
        outs = [torch.empty_like(x) for x in xs]

        def run(i, meta):
            load(spec).launch(xs[i], outs[i], **meta)

        def check(meta):
            run(0, meta)
            return bool(torch.equal(outs[0], reference(xs[0])))

        return run, check, 2


FAMILY = ToyScale()
