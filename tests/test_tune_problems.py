"""kvgen.tune.problems.problem: a (variant, bucket)'s tuning problem draws its random inputs
from a seed of its own, the same in every process, and leaves torch's random state alone."""

import os
import subprocess
import sys
from types import SimpleNamespace

import torch

from kvgen.families.mxfp4_mla import StoreMXFP4MLASpec
from kvgen.tune import problems

SPEC = StoreMXFP4MLASpec(32, 512, "bf16", "paged", "sm90", "interp")
OTHER = StoreMXFP4MLASpec(32, 512, "fp16", "paged", "sm90", "interp")


def _drawing_family(monkeypatch):
    """Every family's tuning problem: random values and a permutation, as the stores' are."""

    def tuning_problem(spec, bucket, device):
        return torch.randn(8, device=device), torch.randperm(100, device=device)

    fake = SimpleNamespace(tuning_problem=tuning_problem)
    monkeypatch.setattr(problems.registry, "family", lambda name: fake)


def test_a_problem_is_drawn_alike_each_time_and_apart_from_other_problems(monkeypatch):
    _drawing_family(monkeypatch)
    bucket = {"num_tokens": 64}
    x1, p1 = problems.problem(SPEC, bucket, "cpu")
    torch.randn(1000)  # whatever ran before it in the process
    x2, p2 = problems.problem(SPEC, bucket, "cpu")
    assert torch.equal(x1, x2) and torch.equal(p1, p2)
    x3, _ = problems.problem(SPEC, {"num_tokens": 4096}, "cpu")
    x4, _ = problems.problem(OTHER, bucket, "cpu")
    assert not torch.equal(x1, x3) and not torch.equal(x1, x4)


def test_a_problem_leaves_torchs_random_state_as_it_was(monkeypatch):
    _drawing_family(monkeypatch)
    torch.manual_seed(123)
    want = torch.randn(4)
    torch.manual_seed(123)
    problems.problem(SPEC, {"num_tokens": 64}, "cpu")
    assert torch.equal(torch.randn(4), want)


def test_the_seed_is_the_same_in_every_process():
    """Not Python's own hash of a string, which each process salts (PYTHONHASHSEED)."""
    code = (
        "from kvgen.families.mxfp4_mla import StoreMXFP4MLASpec as S; "
        "from kvgen.tune.problems import problem_seed; "
        "print(problem_seed(S(32, 512, 'bf16', 'paged', 'sm90', 'interp'), {'num_tokens': 64}))"
    )
    seeds = {
        subprocess.run(
            [sys.executable, "-c", code], env=dict(os.environ, PYTHONHASHSEED=salt),
            capture_output=True, text=True, check=True, timeout=120,
        ).stdout.strip()
        for salt in ("1", "2")
    }  # fmt: skip
    assert seeds == {str(problems.problem_seed(SPEC, {"num_tokens": 64}))}
    assert 0 <= problems.problem_seed(SPEC, {"num_tokens": 64}) < 2**63
