"""The MXFP4 store and reader tuning problems check a candidate over a prefix of at most
``CHECK_TOKENS`` tokens of the bucket's (the reference runs on the CPU), byte for byte, and a
candidate that writes nothing fails the check."""

import pytest
import torch

from kvgen.families.mxfp4_mla import (
    GatherMXFP4MLASpec,
    GatherMXFP4RopeMLASpec,
    StoreMXFP4MLASpec,
    StoreMXFP4RopeMLASpec,
    tuning,
)

PREFIX, TOKENS = 16, 64  # (CHECK_TOKENS made small, so that the bucket is longer)


def _problems(arch, target):
    return [
        (tuning.store_problem, StoreMXFP4MLASpec(32, 512, "bf16", "paged", arch, target)),
        (
            tuning.store_rope_problem,
            StoreMXFP4RopeMLASpec(32, 512, "bf16", "paged", arch, target, rope=64),
        ),
        (tuning.gather_problem, GatherMXFP4MLASpec(32, 512, "bf16", "paged", arch, target)),
        (
            tuning.gather_rope_problem,
            GatherMXFP4RopeMLASpec(32, 512, "bf16", "paged", arch, target, rope=64),
        ),
    ]


@pytest.mark.parametrize("which", range(4), ids=["store", "store_rope", "gather", "gather_rope"])
def test_a_check_covers_a_prefix_and_fails_a_candidate_that_writes_nothing(
    which, device, local_target, monkeypatch
):
    make, spec = _problems(*local_target)[which]
    monkeypatch.setattr(tuning, "CHECK_TOKENS", PREFIX)
    calls = []
    real_load = tuning.load

    def spying_load(s):
        module = real_load(s)

        class Spy:
            @staticmethod
            def launch(*args, skip=False, **meta):
                calls.append(args)
                if not skip:
                    module.launch(*args, **meta)

        return Spy

    monkeypatch.setattr(tuning, "load", spying_load)
    run, check, _ = make(spec, {"num_tokens": TOKENS}, device)
    meta = spec.default_meta(num_tokens=TOKENS)
    assert check(meta)
    # the check launched the kernel on PREFIX tokens (its first tensor's rows), not TOKENS
    first = calls[-1][0]
    assert isinstance(first, torch.Tensor)
    n = first.shape[0] if "store" in spec.family else calls[-1][1].shape[0]
    assert n == PREFIX
    assert not check(meta | {"skip": True})  # nothing written: the poisoned bytes stay
    run(0, meta)  # the timed launch covers the bucket's tokens
    last = calls[-1]
    assert (last[0].shape[0] if "store" in spec.family else last[1].shape[0]) == TOKENS
