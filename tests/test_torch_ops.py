"""kvgen's ops as PyTorch operators: torch.compile(fullgraph=True) traces callers without a graph
break and gives eager's results, meta tensors get the right shapes, the caches are declared
mutated, bad arguments fail the same way through torch.ops.kvgen, and (on a GPU) the ops work
inside a captured CUDA graph."""

import pytest
import torch

import kvgen.ops as ops
from kvgen.verify import make_cache

OPS = (
    "store_mxfp4_mla",
    "gather_mxfp4_mla",
    "reshape_and_cache_flash_per_token_head_quant",
    "reshape_and_cache_flash_int4_per_token_head",
    "gather_kv_per_token_head",
    "get_mla_metadata",
    "flash_mla_with_kvcache",
    "concat_and_cache_mla",
)
MUTATED = {
    "concat_and_cache_mla": ["kv_cache"],
    "store_mxfp4_mla": ["cache"],
    "reshape_and_cache_flash_per_token_head_quant": [
        "key_cache",
        "value_cache",
        "k_scale_cache",
        "v_scale_cache",
    ],
    "reshape_and_cache_flash_int4_per_token_head": [
        "key_cache",
        "value_cache",
        "k_scale_cache",
        "v_scale_cache",
    ],
}
# inductor needs a C++ compiler and a GPU toolchain for CPU/Triton code; the interpreter runs
# the graph eagerly
BACKEND = "inductor" if torch.cuda.is_available() else "eager"


def _inputs(device, seed=0):
    """Small inputs for every public op: stores, readers, metadata and the decode."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    tokens, heads, d = 6, 2, 64
    slots = torch.randperm(32, generator=gen)[:tokens].to(device)
    slots[1] = -1  # skipped
    x = randn(tokens, 512).to(torch.bfloat16)
    mx = make_cache("paged", 32, 272, device, block_size=16, gap_rows=2)
    key, value = randn(tokens, heads, d).to(torch.bfloat16), randn(tokens, heads, d)
    value = value.to(torch.bfloat16)
    i8 = [
        torch.full((2, 16, heads, d), 7, dtype=torch.int8, device=device),
        torch.full((2, 16, heads, d), 7, dtype=torch.int8, device=device),
        torch.full((2, 16, heads), 3.0, device=device),
        torch.full((2, 16, heads), 3.0, device=device),
    ]
    i4 = [
        torch.full((2, 16, heads, d // 2), 0xFF, dtype=torch.uint8, device=device),
        torch.full((2, 16, heads, d // 2), 0xFF, dtype=torch.uint8, device=device),
        torch.full((2, 16, heads, d // 32), 5.0, dtype=torch.float16, device=device),
        torch.full((2, 16, heads, d // 32), 5.0, dtype=torch.float16, device=device),
    ]
    seqlens = torch.tensor([40, 0, 17], dtype=torch.int32, device=device)
    k_cache = randn(6, 16, 1, 288).to(torch.bfloat16)
    table = torch.tensor([[3, 0, 5], [1, 1, 1], [2, 4, 4]], dtype=torch.int32, device=device)
    q = randn(3, 1, 4, 288).to(torch.bfloat16)
    pe = randn(tokens, 64).to(torch.bfloat16)
    mla = torch.full((2, 16, 656), 0xFF, dtype=torch.uint8, device=device)
    return dict(
        pe=pe,
        mla=mla,
        x=x,
        slots=slots,
        mx=mx,
        key=key,
        value=value,
        i8=i8,
        i4=i4,
        seqlens=seqlens,
        k_cache=k_cache,
        table=table,
        q=q,
    )


def _every_op(t):
    """Call each public op once; the results and the caches they wrote."""
    ops.store_mxfp4_mla(t["x"], t["slots"], t["mx"].view)
    latent = ops.gather_mxfp4_mla(t["mx"].view, t["slots"], 512, 32, torch.float32)
    ops.triton_reshape_and_cache_flash_per_token_head_quant(
        t["key"], t["value"], *t["i8"], t["slots"]
    )
    ops.triton_reshape_and_cache_flash_int4_per_token_head(
        t["key"], t["value"], *t["i4"], t["slots"]
    )
    k8, v8 = ops.gather_kv_per_token_head(*t["i8"], t["slots"], out_dtype=torch.float32)
    k4, v4 = ops.gather_kv_per_token_head(*t["i4"], t["slots"], out_dtype=torch.float32)
    meta, splits = ops.get_mla_metadata(t["seqlens"], 4, 1)
    out, lse = ops.flash_mla_with_kvcache(
        t["q"], t["k_cache"], t["table"], t["seqlens"], 256, meta, splits, causal=False
    )
    one = torch.ones(1, device=t["x"].device)
    ops.concat_and_cache_mla(t["x"], t["pe"], t["mla"], t["slots"], "fp8_ds_mla", one)
    return latent, k8, v8, k4, v4, meta, splits, out, lse


def _written(t):
    return [t["mx"].backing, *t["i8"], *t["i4"], t["mla"]]


def _equal(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())


def test_every_op_is_a_torch_op_with_its_caches_mutated():
    for name in OPS:
        schema = getattr(torch.ops.kvgen, name).default._schema
        written = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
        assert written == MUTATED.get(name, []), name


def test_torch_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    eager_in, compiled_in = _inputs(device), _inputs(device)
    want = _every_op(eager_in)
    got = torch.compile(_every_op, fullgraph=True, backend=BACKEND)(compiled_in)
    for a, b in zip(got, want, strict=True):
        _equal(a, b)
    for a, b in zip(_written(compiled_in), _written(eager_in), strict=True):
        _equal(a, b)  # the caches, guard bytes included


def test_meta_tensors_give_shapes_and_run_the_checks():
    t = _inputs("meta")
    latent, k8, v8, k4, v4, meta, splits, out, lse = _every_op(t)
    assert latent.shape == (6, 512) and latent.dtype == torch.float32
    assert k8.shape == v8.shape == k4.shape == v4.shape == (6, 2, 64)
    assert meta.shape[1] == 8 and meta.dtype == torch.int32 and splits.shape == (4,)
    assert out.shape == (3, 1, 4, 256) and out.dtype == torch.bfloat16
    assert lse.shape == (3, 4, 1) and lse.dtype == torch.float32
    assert all(r.device.type == "meta" for r in (latent, k8, meta, out, lse))
    with pytest.raises(ValueError, match="slot_mapping has 5 entries"):
        ops.store_mxfp4_mla(t["x"], t["slots"][:5], t["mx"].view)
    with pytest.raises(ValueError, match="head_dim mismatch"):
        q = t["q"][..., :256].contiguous()
        ops.flash_mla_with_kvcache(q, t["k_cache"], t["table"], t["seqlens"], 256, meta, splits)


def test_torch_ops_check_arguments_as_the_functions_do(device):
    t = _inputs(device)
    before = t["mx"].backing.clone()
    with pytest.raises(ValueError, match="slot_mapping has 5 entries but kv_c_normed has 6"):
        torch.ops.kvgen.store_mxfp4_mla(t["x"], t["slots"][:5], t["mx"].view, 32)
    with pytest.raises(ValueError, match="group must be one of"):
        torch.ops.kvgen.store_mxfp4_mla(t["x"], t["slots"], t["mx"].view, 48)
    assert torch.equal(t["mx"].backing, before)
    before = [c.clone() for c in t["i8"]]
    with pytest.raises(ValueError, match="key_cache has 2 kv heads but key has 1"):
        torch.ops.kvgen.reshape_and_cache_flash_per_token_head_quant(
            t["key"][:, :1], t["value"][:, :1], *t["i8"], t["slots"]
        )
    assert all(torch.equal(a, b) for a, b in zip(t["i8"], before, strict=True))


def test_compiled_store_with_a_bad_argument_fails_when_traced(device):
    torch._dynamo.reset()
    t = _inputs(device)
    before = t["mx"].backing.clone()

    def f(x, slots, cache):
        ops.store_mxfp4_mla(x, slots, cache)

    with pytest.raises(Exception, match="slot_mapping has 5 entries"):
        torch.compile(f, fullgraph=True, backend=BACKEND)(t["x"], t["slots"][:5], t["mx"].view)
    assert torch.equal(t["mx"].backing, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_ops_inside_a_captured_cuda_graph_match_eager():
    eager_in, graph_in = _inputs("cuda"), _inputs("cuda")
    want = _every_op(eager_in)
    _every_op(_inputs("cuda"))  # generate, compile and load configs outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # records the launches; the caches are not written yet
        got = _every_op(graph_in)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(got, want, strict=True):
        _equal(a, b)
    for a, b in zip(_written(graph_in), _written(eager_in), strict=True):
        _equal(a, b)
