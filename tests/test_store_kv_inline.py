"""The per-token-head stores on vLLM's allocation, (blocks, 2, page, heads, codes + scale
bytes) with each row's scales in its pad bytes: the ``row_align`` bucket their tuned config is
looked up by, and the bench's and the tuner's cases in that layout."""

import pytest
import torch

from kvgen import configs, runtime
from kvgen.bench.store import kv_cases
from kvgen.families.gqa_decode.verify import alloc_caches
from kvgen.families.per_token_head import StoreKVInt4Spec, StoreKVPerTokenHeadSpec, row_align
from kvgen.families.per_token_head.tuning import store_problem
from kvgen.ops import (
    triton_reshape_and_cache_flash_int4_per_token_head,
    triton_reshape_and_cache_flash_per_token_head_quant,
)


@pytest.mark.parametrize(
    ("kv", "d", "inline"),
    [("int8", 128, 4), ("fp8e4m3", 576, 4), ("int4", 128, 8), ("int4", 576, 4)],
)
def test_row_align_is_16_for_caches_of_their_own_and_less_for_vllm_rows(kv, d, inline):
    group = 32 if kv == "int4" else 0
    k, v, *_ = alloc_caches(kv, group, (3, 16, 2), d, d, torch.bfloat16, "cpu", "inline")
    assert row_align(k, v) == inline  # 132-byte rows (int8 at 128), 72 (int4 at 128), ...
    k, v, *_ = alloc_caches(kv, group, (3, 16, 2), d, d, torch.bfloat16, "cpu", "nhd")
    assert row_align(k, v) == 16
    assert row_align(k[:, :, :, 1:]) == 1  # a view one byte in


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_the_store_looks_its_config_up_by_the_caches_row_align(kv, device, monkeypatch):
    seen = []
    real = runtime.meta_params

    def spy(spec, **size):
        seen.append(size)
        return real(spec, **size)

    monkeypatch.setattr(runtime, "meta_params", spy)
    group = 32 if kv == "int4" else 0
    store = (
        triton_reshape_and_cache_flash_int4_per_token_head
        if kv == "int4"
        else triton_reshape_and_cache_flash_per_token_head_quant
    )
    for layout, want in (("inline", 8 if kv == "int4" else 4), ("nhd", 16)):
        caches = alloc_caches(kv, group, (2, 16, 2), 128, 128, torch.bfloat16, device, layout)
        key, value = (torch.randn(5, 2, 128, device=device).bfloat16() for _ in range(2))
        store(key, value, *caches, torch.arange(5, device=device))
        assert seen[-1] == {"num_tokens": 5, "num_heads": 2, "row_align": want}


def test_a_row_align_bucket_takes_its_own_config_or_else_the_nearest_tuned_one(
    tmp_path, monkeypatch
):
    """vLLM's rows (row_align 4) use their own tuned config where the JSON has one, and the
    separate-scale-cache bucket's (row_align 16) until theirs is tuned."""
    import json

    from kvgen._resources import tuned_configs_dir

    spec = StoreKVPerTokenHeadSpec("int8", 128, 128, "bf16", "sm90", "gpu")
    doc = json.loads((tuned_configs_dir() / "sm90" / f"{spec.family}.json").read_text())
    entries = doc["entries"][spec.name]
    aligned, inline = (
        "num_tokens=65536,num_heads=8,row_align=16",
        "num_tokens=65536,num_heads=8,row_align=4",
    )
    # the packaged JSON with the two buckets' configs made to differ (so that the lookup shows
    # which one it took), then without the row_align 4 buckets
    want = entries[aligned]["meta"]
    own = {**want, "num_warps": 4 if want["num_warps"] != 4 else 2}
    entries[inline] = {**entries[inline], "meta": own}
    (tmp_path / "sm90").mkdir()
    path = tmp_path / "sm90" / f"{spec.family}.json"
    monkeypatch.setenv(configs.OVERRIDE_ENV, str(tmp_path))
    try:
        path.write_text(json.dumps(doc))
        configs.reset()
        got = configs.meta_params(spec, num_tokens=65536, num_heads=8, row_align=4)
        assert {k: got[k] for k in own} == own
        doc["entries"] = {spec.name: {k: e for k, e in entries.items() if "row_align=16" in k}}
        path.write_text(json.dumps(doc))
        configs.reset()
        got = configs.meta_params(spec, num_tokens=65536, num_heads=8, row_align=4)
        assert {k: got[k] for k in want} == want
    finally:
        monkeypatch.delenv(configs.OVERRIDE_ENV)
        configs.reset()


@pytest.mark.parametrize("fmt", ["int8", "fp8e5m2", "int4"])
def test_the_bench_stores_into_vllm_rows_and_checks_every_byte(fmt, device):
    case = next(kv_cases(device, (7,), fmt, 2, 128, layout="inline"))
    assert case.variant.endswith("-inline")
    k, v, kc, vc, ks, vs, slots = case.data[0]
    assert kc.storage_offset() == 0 and ks.untyped_storage().data_ptr() == kc.data_ptr()
    assert row_align(kc, vc) < 16
    assert case.check()
    with pytest.raises(ValueError, match="layout must be one of"):
        next(kv_cases(device, (7,), fmt, 2, 128, layout="hnd"))


@pytest.mark.parametrize("family", ["store_kv_per_token_head", "store_kv_int4_per_token_head"])
@pytest.mark.parametrize("align", [4, 16])
def test_a_tuning_trial_of_a_row_align_bucket_stores_into_that_layout(
    family, align, device, local_target, monkeypatch
):
    import kvgen.bench.store as store

    arch, target = local_target
    if family == "store_kv_int4_per_token_head":
        spec = StoreKVInt4Spec(32, 128, 128, "bf16", arch, target)
    else:
        spec = StoreKVPerTokenHeadSpec("fp8e4m3", 128, 128, "bf16", arch, target)

    layouts = []
    real = store.kv_cases

    def spy(*args, **kwargs):
        layouts.append(kwargs.get("layout"))
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "kv_cases", spy)
    bucket = {"num_tokens": 9, "num_heads": 2, "row_align": align}
    run, check, n_sets = store_problem(spec, bucket, device)
    assert layouts == ["inline" if align < 16 else "separate"]
    meta = spec.default_meta(num_tokens=9, num_heads=2)
    run(0, meta)
    assert check(meta)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_kernel_is_told_the_alignment_the_tuned_bucket_is_keyed_by(fmt):
    """The generated launcher passes its kernel ROW_ALIGN (a promise: every row starts at a
    multiple of it, so the codes go out several to a store): it must be the package's
    ``row_align`` of the same caches, on separate caches, vLLM's inline rows, an HND view and
    caches starting at an odd byte."""
    from kvgen.codegen import load
    from kvgen.families.per_token_head import row_align as package_row_align

    if fmt == "int4":
        spec = StoreKVInt4Spec(32, 128, 128, "bf16", "sm90", "gpu")
    else:
        spec = StoreKVPerTokenHeadSpec(fmt, 128, 128, "bf16", "sm90", "gpu")
    launcher_row_align = load(spec).row_align
    seen = set()
    for layout in ("separate", "inline"):
        kc, vc, _, _ = alloc_caches(fmt, 32, (3, 16, 2), 128, 128, torch.bfloat16, "cpu", layout)
        hnd = (kc.permute(0, 2, 1, 3), vc.permute(0, 2, 1, 3))
        for caches in ((kc, vc), hnd):
            assert launcher_row_align(*caches) == package_row_align(*caches)
            seen.add(launcher_row_align(*caches))
    raw = torch.zeros(3 * 16 * 2 * 64 + 1, dtype=torch.uint8)
    odd = raw[1:].view(3, 16, 2, 64)  # starts at an odd byte: nothing wider than a byte
    assert launcher_row_align(odd, odd) == package_row_align(odd, odd) == 1
    assert seen == {16, 4 if fmt == "int8" else 8}


@pytest.mark.parametrize("fmt", ["int8", "fp8e4m3"])
@pytest.mark.parametrize(
    ("head_size", "tokens", "heads", "warps", "layout"),
    [
        (128, 1, 8, 1, (4, 4)),  # a thread: 4 runs of 4 channels, 8 lanes a row
        (128, 1, 8, 4, (4, 2)),
        (128, 2, 4, 8, (0, 1)),  # a thread's share is 4 channels: the compiler's layout
        (72, 8, 8, 1, (4, 4)),  # 64 + a masked 8: the narrow tile holds 2 runs, not 4
        (80, 2, 8, 1, (4, 2)),  # 64 + 16
    ],
)
def test_every_thread_layout_of_the_store_on_vllm_rows_writes_the_reference_bytes(
    fmt, head_size, tokens, heads, warps, layout, device, local_target
):
    """The int8 / fp8 store on 4-byte aligned rows gives a thread runs of 4 channels (VEC)
    where it would otherwise load more than it can store: each (VEC, RUNS) the launcher picks,
    on pieces of one width and of several, writes every byte as the reference does (caches
    poisoned with 0xFF first, 11 tokens over 8 heads, slots out of order)."""
    from kvgen.bench.store import kv_store_checker
    from kvgen.codegen import load

    arch, target = local_target
    mod = load(StoreKVPerTokenHeadSpec(fmt, head_size, head_size, "bf16", arch, target))
    assert mod.vector_of(4, tokens, heads, warps) == layout
    assert mod.vector_of(16, tokens, heads, warps) == (0, 1)
    shape = (2, 16, 8)  # blocks, page, heads
    caches = alloc_caches(fmt, 0, shape, head_size, head_size, torch.bfloat16, device, "inline")
    assert row_align(*caches[:2]) == 4
    k, v = (torch.randn(11, 8, head_size, device=device).bfloat16() for _ in range(2))
    slots = torch.randperm(32, device=device)[:11]
    check = kv_store_checker((k, v, *caches, slots))
    meta = {"tokens_per_program": tokens, "heads_per_program": heads, "num_warps": warps}
    assert check(lambda *a: mod.launch(*a, **meta))


@pytest.mark.parametrize(("head_size", "align", "piece"), [(128, 8, 8), (576, 4, 4)])
def test_the_int4_store_on_vllm_rows_writes_the_reference_bytes(
    head_size, align, piece, device, local_target
):
    """int4 rows with their scales inline: 72 bytes at head 128 (8-byte aligned, a thread
    stores 8 bytes of a group at a time) and 324 at 576 (4-byte aligned: pieces of 4 bytes,
    ``piece_of``). Every byte as the reference writes it, caches poisoned with 0xFF first."""
    from kvgen.bench.store import kv_store_checker
    from kvgen.codegen import load

    arch, target = local_target
    mod = load(StoreKVInt4Spec(32, head_size, head_size, "bf16", arch, target))
    caches = alloc_caches("int4", 32, (2, 16, 2), head_size, head_size, torch.bfloat16, device,
                          "inline")  # fmt: skip
    assert row_align(*caches[:2]) == align and mod.piece_of(align) == piece
    assert mod.piece_of(16) == 8
    k, v = (torch.randn(9, 2, head_size, device=device).bfloat16() for _ in range(2))
    check = kv_store_checker((k, v, *caches, torch.randperm(32, device=device)[:9]))
    for units in (32, 256):  # a group a lane; more groups than the tile's lanes
        assert check(lambda *a, u=units: mod.launch(*a, units_per_program=u, num_warps=1))
