"""The GPU timing scripts' host-side parts (benchmarks/gqa_bench_formats.py, rows_max_regs.py):
what they time is chosen on the CPU, so a wrong name fails before a GPU call is spent."""

import pytest
from _scripts import benchmark_script

from kvgen.bench import gqa_decode as bench

FORMATS = benchmark_script("gqa_bench_formats")
MAX_REGS = benchmark_script("rows_max_regs")


def test_the_bf16_cache_is_always_timed_first_and_once():
    chosen = FORMATS.formats_from("int8,bf16,int4C16,int8")
    assert [f[0] for f in chosen] == ["bf16", "int8", "int4 C16"]
    assert chosen[0] == bench.FORMATS[0]  # the bench's own entry: the times are relative to it
    assert chosen[2] == ("int4 C16", "int4", 16, "nhd")


def test_every_bench_format_is_known_by_its_label_without_spaces():
    for entry in bench.FORMATS:
        assert entry in FORMATS.formats_from(entry[0].replace(" ", ""))


def test_an_unknown_format_is_refused_with_the_known_ones():
    with pytest.raises(SystemExit, match="unknown 'int3'.*int4C32inline"):
        FORMATS.formats_from("int8,int3")


def test_rows_max_regs_refuses_an_unknown_kernel_name_before_looking_for_a_gpu():
    with pytest.raises(SystemExit, match="unknown 'gqa-int3'; known: mla-mxfp4, gqa-int4"):
        MAX_REGS.main(["--kernels", "gqa-int8,gqa-int3"])


INLINE_SWEEP = benchmark_script("gqa_rows_inline_sweep")


def test_inline_sweep_refuses_an_unknown_format_before_looking_for_a_gpu():
    with pytest.raises(SystemExit, match="unknown 'int3'; known: int8, fp8e4m3, fp8e5m2, int4"):
        INLINE_SWEEP.main(["--formats", "int8,int3"])


def test_inline_sweep_grid_lies_in_the_rows_variants_search_space():
    """Every point the sweep times is a config the tuner could choose for the rows variant."""
    from kvgen.space import load_space

    space = load_space("gqa_decode_rows.py.j2").params
    assert set(INLINE_SWEEP.GRID) == set(space)
    for name, values in INLINE_SWEEP.GRID.items():
        assert set(values) <= set(space[name]), name


def test_inline_sweep_summary_names_the_best_config_against_the_tuned_one():
    def point(layout, us, tuned=False, correct=True, stages=2):
        return {"layout": layout, "meta": {"num_stages": stages}, "us": us, "correct": correct,
                "tuned": tuned}  # fmt: skip

    good = {"format": "int8", "points": [
        point("nhd", 400.0, tuned=True), point("inline", 560.0, tuned=True),
        point("inline", 500.0, stages=4), point("inline", 450.0, correct=False, stages=3),
    ]}  # fmt: skip
    wrong = {"format": "fp8e4m3", "points": [
        point("nhd", 400.0, tuned=True), point("inline", 590.0, tuned=True, correct=False),
    ]}  # fmt: skip
    first, second = INLINE_SWEEP.summary([good, wrong])
    # the wrong point (faster) is never the best; 560 / 500 = 1.12
    assert 'best 500.0 us at {"num_stages": 4} (1.120x)' in first
    assert "tuned config 560.0 us" in first and "separate caches at the tuned config 400.0" in first
    assert second == "fp8e4m3: the tuned config's result on inline rows is wrong"
