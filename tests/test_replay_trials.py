"""benchmarks/replay_trials.py: a variant's trial launches one by one, synchronised after each,
stopping at the first fault with its round, bucket, config and launch named (fake problem)."""

import torch
from _scripts import benchmark_script

replay = benchmark_script("replay_trials")

VARIANT = "mla_decode_fp8_ds_mla-d576-dv512-bf16-wgmma-sm90-gpu"


def _fake(monkeypatch, fault_at):
    from kvgen.tune import problems

    done = []

    def problem(spec, bucket, device):
        def run(i, meta):
            done.append((bucket["rows"], meta["num_stages"], f"set {i}"))

        def check(meta):
            done.append((bucket["rows"], meta["num_stages"], "check"))
            return True

        return run, check, 2

    def synchronize():  # the fault shows at the first wait after the faulting launch
        if done and done[-1] == fault_at:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(problems, "problem", problem)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    return done


def test_each_launch_is_waited_on_and_the_first_fault_is_named(monkeypatch, capsys):
    done = _fake(monkeypatch, fault_at=(64, 3, "set 1"))
    metas = ['{"block_n": 32, "num_stages": 2, "split_factor": 1}',
             '{"block_n": 32, "num_stages": 3, "split_factor": 1}']  # fmt: skip
    argv = [VARIANT, "--rows", "32,64", "--quick", "--meta", metas[0], "--meta", metas[1]]
    assert replay.main(argv) == 1
    out = capsys.readouterr().out
    assert "FAULT round 0 rows=64 {'block_n': 32, 'num_stages': 3, 'split_factor': 1} set 1" in out
    assert done[-1] == (64, 3, "set 1")  # nothing launched after it
    assert done[:3] == [(32, 2, "check"), (32, 2, "set 0"), (32, 2, "set 1")]


def test_no_fault_over_every_round(monkeypatch, capsys):
    from kvgen import registry
    from kvgen.runtime import meta_params

    done = _fake(monkeypatch, fault_at=None)
    assert replay.main([VARIANT, "--rows", "16", "--rounds", "2", "--quick"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("no fault")
    # the default config and the tuned one (once where they are the same), three launches each
    (spec,) = registry.lookup([VARIANT], "sm90", "gpu")
    configs = [spec.default_meta(rows=16)]
    configs += [m for m in [meta_params(spec, rows=16)] if m not in configs]
    assert len(done) == 2 * 3 * len(configs)
    assert [n for _, n, _ in done[: 3 * len(configs)]] == [
        m["num_stages"] for m in configs for _ in range(3)
    ]
