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


SLOT_ORDER = benchmark_script("store_slot_order")


def test_slot_mapping_orders_distinct_slots():
    import torch

    from kvgen.bench import store

    seq = store.slot_mapping(100, 128, "cpu", "sequential")
    assert seq.tolist() == list(range(100))
    rnd = store.slot_mapping(100, 128, "cpu", "random")
    assert len(set(rnd.tolist())) == 100 and 0 <= int(rnd.min()) and int(rnd.max()) < 128
    assert rnd.dtype == seq.dtype == torch.int64
    with pytest.raises(ValueError, match="slot order must be one of"):
        store.slot_mapping(4, 8, "cpu", "backwards")
    with pytest.raises(ValueError, match="do not fit"):
        store.slot_mapping(9, 8, "cpu", "sequential")
    # paged: whole pages of 16 drawn at random, each filled in token order; the last one part
    torch.manual_seed(0)
    paged = store.slot_mapping(100, 160, "cpu", "paged", 16)
    assert len(set(paged.tolist())) == 100 and int(paged.max()) < 160
    pages = paged.view(-1)[:96].view(6, 16)
    assert (pages % 16 == torch.arange(16)).all() and (pages // 16 == pages[:, :1] // 16).all()
    assert paged[96:].tolist() == list(range(int(paged[96]), int(paged[96]) + 4))
    assert int(paged[96]) % 16 == 0
    assert (pages[:, 0] // 16).tolist() != list(range(6))  # (seeded) pages out of order
    with pytest.raises(ValueError, match="whole pages"):
        store.slot_mapping(10, 100, "cpu", "paged", 16)


def test_slot_order_script_refuses_unknown_stores_before_looking_for_a_gpu():
    with pytest.raises(SystemExit):
        SLOT_ORDER.main(["--stores", "mxfp4,int3-1x576-inline"])
    with pytest.raises(SystemExit):
        SLOT_ORDER.main(["--orders", "random,backwards"])
    assert {"mxfp4", "int8-1x576-inline", "int4-8x128-separate"} <= set(SLOT_ORDER.STORES)
    assert all(s in SLOT_ORDER.STORES for s in SLOT_ORDER.DEFAULT.split(","))


def test_slot_order_summary_takes_medians_and_names_a_wrong_store():
    def point(store, order, us, x, correct=True, floor=None):
        return {"store": store, "order": order, "us": us, "x_copy": x, "floor_x_copy": floor,
                "correct": correct, "goal": 0.93}  # fmt: skip

    points = [
        point("mxfp4", "random", 40.0, 0.89, floor=0.70),
        point("mxfp4", "sequential", 36.0, 0.95, floor=0.90),
        point("mxfp4", "random", 42.0, 0.85, floor=0.68),
        point("mxfp4", "sequential", 38.0, 0.93, floor=0.88),
        point("mxfp4", "paged", 39.0, 0.91, floor=0.85),
        point("int8-1x576-inline", "random", 60.0, 0.80),
        point("int8-1x576-inline", "sequential", 55.0, 0.88, correct=False),
    ]
    first, second = SLOT_ORDER.summary(points)
    assert first == ("mxfp4 (goal 0.93): random 41.00 us (0.870 of copy, floor 0.690); "
                     "sequential 37.00 us (0.940 of copy, floor 0.890); paged 39.00 us (0.910 "
                     "of copy, floor 0.850); sequential / random 0.902; paged / random "
                     "0.951")  # fmt: skip
    assert second == "int8-1x576-inline: WRONG result (see the points above)"


def test_kv_store_cases_write_the_slots_of_their_order(device):
    """``kv_cases`` with sequential slots: the set's slot mapping is 0..t-1, and the store it
    times writes exactly those rows (the check passes), on vLLM's inline rows too."""
    from kvgen.bench import store

    for layout in ("separate", "inline"):
        (case,) = store.kv_cases(device, (16,), "int8", 2, 64, layout=layout,
                                 slot_order="sequential")  # fmt: skip
        assert case.data[0][-1].tolist() == list(range(16))
        assert case.check()
    # paged: runs of whole 16-slot pages (the cache's block size), still checked byte for byte
    (case,) = store.kv_cases(device, (20,), "int4", 2, 64, layout="inline", slot_order="paged")
    slots = case.data[0][-1]
    assert int(slots[0]) % 16 == 0 and int(slots[16]) % 16 == 0
    assert (slots[1:16] - slots[:15]).eq(1).all() and (slots[17:] - slots[16:19]).eq(1).all()
    assert case.check()
