"""Compile representative generated kernels for sm90 with Triton's real GPU pipeline (PTX, then
its bundled ptxas): run by tests/test_gpu_compile.py in a process without TRITON_INTERPRET, so
that triton.jit yields real JITFunctions. Prints one line per kernel; exits 1 on any failure.

With KVGEN_PTX_DIR set, each kernel's PTX (its debug sections, which name the cache's paths,
cut) is written there, a file per (label, constexprs) whose first line names them:
``benchmarks/ptx_compare.py`` compares two such folders, e.g. of a change's base and head, to
show which kernels a change to the templates changed at all. With KVGEN_SASS_DIR set, each
kernel's SASS and resource usage go there: ``benchmarks/sass_stats.py`` lists (or compares)
their registers, stack, shared memory, instructions and main loop."""

import hashlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from kvgen.codegen import load  # noqa: E402
from kvgen.families.gqa_decode import GQADecodeSpec  # noqa: E402
from kvgen.families.mla_cache import ConcatAndCacheMLASpec, GatherMLACacheSpec  # noqa: E402
from kvgen.families.mla_decode import (  # noqa: E402
    MLADecodeDSMLASpec,
    MLADecodeFP8Spec,
    MLADecodeMXFP4Spec,
    MLADecodeSpec,
)
from kvgen.families.mxfp4_mla import (  # noqa: E402
    GatherMXFP4MLASpec,
    GatherMXFP4RopeMLASpec,
    StoreMXFP4MLASpec,
    StoreMXFP4RopeMLASpec,
)
from kvgen.families.per_token_head import StoreKVInt4Spec, StoreKVPerTokenHeadSpec  # noqa: E402

PTR = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
GL = {"bf16": gl.bfloat16, "fp16": gl.float16}
failures = 0


def compile_fn(label, fn, types, constexprs, warps=4, aligned=(), **options):
    """``aligned``: arguments the launch specialises as multiples of 16 (pointers 16-byte
    aligned, strides of 16 elements), as Triton does for such values."""
    global failures
    sig = {n: ("constexpr" if n in constexprs else types.get(n, "i32")) for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    try:
        source = GluonASTSource if getattr(fn, "is_gluon", lambda: False)() else ASTSource
        kernel = triton.compile(
            source(fn, sig, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": warps, "num_stages": 1, **options},
        )
        assert kernel.asm["cubin"]
        print(f"ok   {label} {constexprs}")
        keep_ptx(label, constexprs, kernel.asm["ptx"])
        keep_sass(label, constexprs, kernel)
        return kernel
    except Exception as exc:  # report every kernel, then fail
        failures += 1
        print(f"FAIL {label} {constexprs}: {str(exc)[-800:]}")
        return None


def kept_file(env: str, label, constexprs, suffix: str) -> tuple[Path | None, str]:
    """``(path, name)``: where a kernel's ``suffix`` file goes under the folder ``env`` names
    (None when it is not set; made where it does not exist), and the kernel's name (label and
    constexprs)."""
    folder = os.environ.get(env)
    name = f"{label} {sorted(constexprs.items())}"
    if not folder:
        return None, name
    Path(folder).mkdir(parents=True, exist_ok=True)
    return Path(folder) / f"{hashlib.sha1(name.encode()).hexdigest()[:16]}{suffix}", name


def keep_ptx(label, constexprs, ptx: str) -> None:
    """Write ``ptx`` under KVGEN_PTX_DIR (when set), cut before its first debug section."""
    path, name = kept_file("KVGEN_PTX_DIR", label, constexprs, ".ptx")
    if path is None:
        return
    lines = ptx.splitlines()
    cut = next((i for i, line in enumerate(lines) if re.match(r"\s*\.section\s+\.debug", line)),
               len(lines))  # fmt: skip
    path.write_text(f"// {name}\n" + "\n".join(lines[:cut]) + "\n")


def keep_sass(label, constexprs, kernel) -> None:
    """Write ``kernel``'s SASS under KVGEN_SASS_DIR (when set), after a line naming it and one
    of its resource usage (cuobjdump's registers and stack a thread, the shared memory), for
    ``benchmarks/sass_stats.py``."""
    path, name = kept_file("KVGEN_SASS_DIR", label, constexprs, ".sass")
    if path is None:
        return
    res = cubin_tool(kernel, "cuobjdump", "--dump-resource-usage")
    usage = " ".join(re.findall(r"(?:REG|STACK):\d+", res))
    path.write_text(f"// {name}\n// {usage} SHARED:{kernel.metadata.shared}\n{sass(kernel)}")


def cubin_tool(kernel, tool: str, *args: str) -> str:
    """The output of Triton's own ``tool`` (nvdisasm, cuobjdump) over ``kernel``'s cubin."""
    exe = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([str(exe), *args, f.name], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def sass(kernel) -> str:
    """``kernel``'s SASS, read with Triton's own nvdisasm."""
    return cubin_tool(kernel, "nvdisasm", "-c")


def compile_ones(label, fn, types, constexprs, warps=4, aligned=(), **options):
    """``compile_fn`` with every integer argument 1, which a launch passes as the constant 1
    (Triton specialises an integer argument equal to 1): a cache of one block, one sequence, one
    head, a unit stride. Code that calls a tensor's method on such an argument (``n.to(...)``)
    compiles in the interpreter and for other values, and fails here. ``aligned``: arguments
    the launcher guarantees are multiples of 16 (never 1), compiled as such."""
    scalar = ("*", "fp", "tensordesc")
    kept = {p.name for p in fn.params if p.do_not_specialize}  # (never made constants)
    ones = {n: 1 for n in fn.arg_names if n not in constexprs and n not in aligned
            and n not in kept and not types.get(n, "i32").startswith(scalar)}  # fmt: skip
    return compile_fn(f"{label} (integers 1)", fn, types, {**constexprs, **ones}, warps,
                      aligned=aligned, **options)  # fmt: skip


for spec in (
    StoreMXFP4MLASpec(32, 512, "bf16", "paged"),
    StoreMXFP4MLASpec(64, 448, "fp32", "flat"),
):
    words = "*i64" if spec.dtype == "fp32" else "*i32"
    types = {"words_ptr": words, "slot_ptr": "*i64", "cache_ptr": "*u8"}
    for rows, warps in ((1, 4), (4, 2)):
        compile_fn(spec.name, load(spec).store_kernel, types, {"ROWS": rows}, warps)
    compile_ones(spec.name, load(spec).store_kernel, types, {"ROWS": 4}, 2)
for spec in (
    StoreMXFP4RopeMLASpec(32, 512, "bf16", "paged", rope=64),
    StoreMXFP4RopeMLASpec(16, 512, "fp32", "flat", rope=64),
):
    words = "*i64" if spec.dtype == "fp32" else "*i32"
    types = {"words_ptr": words, "pe_ptr": PTR[spec.dtype], "slot_ptr": "*i64", "cache_ptr": "*u8"}
    compile_fn(spec.name, load(spec).store_kernel, types, {"ROWS": 4}, 2)
    compile_ones(spec.name, load(spec).store_kernel, types, {"ROWS": 4}, 2)
for spec in (
    GatherMXFP4RopeMLASpec(32, 512, "bf16", "paged", rope=64),
    GatherMXFP4RopeMLASpec(64, 512, "fp16", "flat", rope=64),
):
    types = {"cache_ptr": "*u8", "slot_ptr": "*i64", "out_ptr": PTR[spec.dtype]}
    compile_fn(spec.name, load(spec).gather_kernel, types, {"ROWS": 4})
    compile_ones(spec.name, load(spec).gather_kernel, types, {"ROWS": 4})
spec = GatherMXFP4MLASpec(32, 448, "bf16", "paged")
compile_fn(
    spec.name,
    load(spec).gather_kernel,
    {"cache_ptr": "*u8", "slot_ptr": "*i64", "out_ptr": "*bf16"},
    {"ROWS": 4},
)


def byte_accesses(kernel, op: str = "STG") -> int:
    """How many global stores (``op`` STG) or loads (LDG) of ``kernel`` move one byte (SASS
    STG.E.U8 / LDG.E.U8)."""
    return sass(kernel).count(f"{op}.E.U8")


def exchanges(kernel) -> int:
    """How many shared-memory stores and warp shuffles (SASS STS, SHFL) ``kernel`` has: in a
    store kernel, the layout conversions the compiler put between its loads and its stores, and
    the reductions over a row or a scale group split over several lanes."""
    return len(re.findall(r"\b(?:STS|SHFL)\b", sass(kernel)))


def no_narrower(label, aligned, inline, inline_align, op):
    """Fail if the kernel compiled for vLLM's inline rows (aligned to ``inline_align`` bytes)
    moves more single bytes (``op``: STG / LDG) than the one compiled for 16-byte rows."""
    global failures
    if aligned is None or inline is None:
        return
    wide, narrow = byte_accesses(aligned, op), byte_accesses(inline, op)
    verdict = "FAIL" if narrow > wide else "ok  "
    failures += narrow > wide
    print(f"{verdict} {label}: {narrow} one-byte {op} on {inline_align}-byte aligned rows, "
          f"{wide} on 16")  # fmt: skip


def compile_store(spec, types, constexprs, inline_align):
    """The store at ``constexprs`` for 16-byte aligned rows and for vLLM's rows with the scales
    in their pad bytes (``inline_align``: 132-byte int8 / fp8 rows are 4-byte aligned, 72-byte
    int4 rows 8): the latter must write its codes as wide as the former where the layout lets
    a thread hold several (before the kernel was told the rows' alignment, a 132-byte row went
    out a byte a store). Pointers 16-byte aligned, as torch allocates; the inline rows' strides
    of unknown divisibility, as Triton sees 132 or 72."""
    mod = load(spec)
    fn = mod.store_kernel

    def align(row_align):  # (and what the launcher derives from it: VEC, RUNS / PIECE)
        more = {}
        if hasattr(mod, "vector_of"):
            rows = constexprs["TOKENS"], constexprs["HEADS"]
            more["VEC"], more["RUNS"] = mod.vector_of(row_align, *rows, num_warps=4)
        if hasattr(mod, "piece_of"):
            more["PIECE"] = mod.piece_of(row_align)
        return {**constexprs, "ROW_ALIGN": row_align, **more}

    # separate caches: Triton sees their strides as multiples of 16 itself
    strides = [n for n in fn.arg_names if n.startswith(("stride_kc_", "stride_vc_"))]
    aligned = compile_fn(spec.name, fn, types, align(16), aligned=[*types, *strides])
    inline = compile_fn(spec.name, fn, types, align(inline_align), aligned=types)
    compile_ones(spec.name, fn, types, align(inline_align))
    no_narrower(f"{spec.name} {constexprs}", aligned, inline, inline_align, "STG")
    if not (isinstance(spec, StoreKVInt4Spec) and inline_align == 4):
        no_more_exchanges(f"{spec.name} {constexprs}", aligned, inline, inline_align)
    # (the int4 store on 4-byte rows hands its words to the lanes through shared memory on
    # purpose: a word a lane, a row's words on consecutive lanes)


def no_more_exchanges(label, aligned, inline, inline_align):
    """Fail if the kernel compiled for ``inline_align``-byte aligned rows exchanges values
    between threads (``exchanges``) more than the one compiled for 16-byte rows: where a store
    can write fewer bytes a thread than a thread loads, the compiler converts between the two
    layouts through shared memory in every program, or spreads a row or a scale group over more
    lanes (the stores give a thread the same channels as the loads instead: the int8 / fp8
    store's VEC and RUNS, the int4 store's PIECE)."""
    global failures
    if aligned is None or inline is None:
        return
    wide, narrow = exchanges(aligned), exchanges(inline)
    verdict = "FAIL" if narrow > wide else "ok  "
    failures += narrow > wide
    print(f"{verdict} {label}: {narrow} shared-memory stores and shuffles on {inline_align}-byte "
          f"aligned rows, {wide} on 16")  # fmt: skip


for spec in (
    StoreKVPerTokenHeadSpec("int8", 128, 128, "bf16"),
    StoreKVPerTokenHeadSpec("fp8e4m3", 576, 512, "bf16"),
    StoreKVPerTokenHeadSpec("fp8e5m2", 80, 96, "fp16"),
    StoreKVInt4Spec(32, 128, 128, "bf16"),
    StoreKVInt4Spec(16, 80, 64, "fp32"),
    StoreKVInt4Spec(64, 576, 512, "fp16"),
    StoreKVInt4Spec(32, 81, 63, "bf16"),
):
    cache = {"int8": "*i8", "fp8e4m3": "*fp8e4nv", "fp8e5m2": "*fp8e5"}.get(
        getattr(spec, "fmt", ""), "*u8"
    )
    scale = "*fp16" if cache == "*u8" else "*fp32"
    src = PTR[spec.in_dtype]
    if getattr(load(spec), "WORD_DTYPE", None) is not None:  # int4 reads pairs as words
        src = "*i64" if spec.in_dtype == "fp32" else "*i32"
    types = {
        "key_ptr": src,
        "value_ptr": src,
        "key_cache_ptr": cache,
        "value_cache_ptr": cache,
        "k_scale_ptr": scale,
        "v_scale_ptr": scale,
        "slot_ptr": "*i64",
    }
    if isinstance(spec, StoreKVInt4Spec):  # scale groups a program, 64-bit unit indices
        # (72-byte rows at head 128 are 8-byte aligned, 324-byte rows at 576 only 4)
        for units, wide in ((32, False), (256, False), (64, True)):
            compile_store(spec, types, {"UNITS": units, "WIDE": wide}, 8)
            compile_store(spec, types, {"UNITS": units, "WIDE": wide}, 4)
        continue
    for tokens, heads in ((1, 8), (4, 2), (1, 1)):
        compile_store(spec, types, {"TOKENS": tokens, "HEADS": heads}, 4)

for spec in (
    ConcatAndCacheMLASpec("auto", 512, 64, "bf16"),
    ConcatAndCacheMLASpec("fp8", 512, 64, "fp16"),
    ConcatAndCacheMLASpec("fp8_ds_mla", 512, 64, "bf16"),
    ConcatAndCacheMLASpec("fp8_ds_mla", 512, 64, "fp32"),
):
    src = PTR[spec.in_dtype]
    cache = src if spec.fmt == "auto" else "*u8"
    types = {"kv_ptr": src, "pe_ptr": src, "cache_ptr": cache, "slot_ptr": "*i64"}
    types["scale_ptr"] = "*fp32"
    for tokens in (1, 4):
        compile_fn(spec.name, load(spec).store_kernel, types, {"TOKENS": tokens})
    compile_ones(spec.name, load(spec).store_kernel, types, {"TOKENS": 4})

for spec in (GatherMLACacheSpec("fp8", 512, 64, "bf16"), GatherMLACacheSpec("fp8_ds_mla")):
    types = {"cache_ptr": "*u8", "slot_ptr": "*i64", "scale_ptr": "*fp32"}
    types["out_ptr"] = PTR[spec.dtype]
    for rows in (1, 4):
        compile_fn(spec.name, load(spec).gather_kernel, types, {"ROWS": rows})
    compile_ones(spec.name, load(spec).gather_kernel, types, {"ROWS": 4})

for ds, bh, bn in (
    [(MLADecodeDSMLASpec(576, 512, "bf16"), bh, bn) for bh, bn in ((16, 32), (64, 64))]
    + [(MLADecodeFP8Spec(576, 512, dt), 16, 32) for dt in ("bf16", "fp16")]
    + [(MLADecodeMXFP4Spec(d, 512, dt), 16, 32) for d in (576, 512) for dt in ("bf16", "fp16")]
    + [(MLADecodeMXFP4Spec(576, 512, "bf16", group=g), 16, 32) for g in (16, 64)]
):
    types = {n: "*i32" for n in ("block_table_ptr", "seqlens_ptr", "meta_ptr", "num_splits_ptr")}
    types |= {"q_ptr": PTR[ds.dtype], "k_ptr": "*u8", "o_acc_ptr": "*fp32", "lse_acc_ptr": "*fp32"}
    types["k_scale_ptr"] = "*fp32"
    types["scale_log2"] = "fp32"
    constexprs = {"CAUSAL": True, "BLOCK_H": bh, "BLOCK_N": bn, "NUM_STAGES": 2}
    constexprs |= {"PAGE_AHEAD": False, "TILE_IN_PAGE": bh == 64, "ONE_KV_HEAD": True}
    compile_fn(ds.name, load(ds).split_kernel, types, constexprs)
    if bh == 16:
        compile_ones(ds.name, load(ds).split_kernel, types, constexprs)
    # the combine kernel that checks the block table (the quantized formats' portable variant)
    types = {n: "*i32" for n in ("num_splits_ptr", "block_table_ptr", "seqlens_ptr")}
    types |= {"o_acc_ptr": "*fp32", "lse_acc_ptr": "*fp32", "out_ptr": PTR[ds.dtype]}
    types["lse_ptr"] = "*fp32"
    constexprs = {"BLOCK_H": 16, "BLOCK_V": 128, "ONE_KV_HEAD": bh == 16, "TABLE_BLOCK": 64}
    compile_fn(ds.name, load(ds).combine_kernel, types, constexprs)

# The GQA decode: each K conversion (fp16 PTX) and V reading (32-bit words and PTX, or codes),
# pages by shift or by division, bf16 and fp16 queries
GQA_CACHE = {"int8": "*i8", "fp8e4m3": "*fp8e4nv", "fp8e5m2": "*fp8e5", "int4": "*u8"}
for gs, words, pow2 in (
    (GQADecodeSpec(128, 128, "bf16", "int8", 0, "portable", "sm90", "gpu"), True, True),
    (GQADecodeSpec(128, 128, "fp16", "fp8e4m3", 0, "portable", "sm90", "gpu"), True, False),
    (GQADecodeSpec(64, 48, "bf16", "fp8e5m2", 0, "portable", "sm90", "gpu"), False, True),
    (GQADecodeSpec(128, 128, "bf16", "int4", 32, "portable", "sm90", "gpu"), False, True),
):
    scale = "*fp16" if gs.kv == "int4" else "*fp32"
    types = {"q_ptr": PTR[gs.dtype], "k_ptr": GQA_CACHE[gs.kv], "v_ptr": GQA_CACHE[gs.kv]}
    types |= {"ks_ptr": scale, "vs_ptr": scale, "block_table_ptr": "*i32"}
    types |= {"seqlens_ptr": "*i32", "o_acc_ptr": "*fp32", "lse_acc_ptr": "*fp32"}
    types["scale_log2"] = "fp32"
    constexprs = {"CAUSAL": False, "BLOCK_H": 16, "BLOCK_N": 64, "NUM_STAGES": 2}
    constexprs |= {"TILE_IN_PAGE": False, "PAGE_POW2": pow2, "V_WORDS": words, "TABLE_BLOCK": 64}
    fn = load(gs).split_kernel
    constexprs = {k: v for k, v in constexprs.items() if k in fn.arg_names}  # (int4: no V_WORDS)
    strides = [n for n in fn.arg_names if n.startswith(("stride_k_", "stride_v_"))]
    aligned = compile_fn(gs.name, fn, types, {**constexprs, "ROW_ALIGN": 16},
                         aligned=("k_ptr", "v_ptr", *strides))  # fmt: skip
    # vLLM's rows with the scales in their pad bytes (132 bytes: 4-byte aligned; int4's 72:
    # 8): K and V read no narrower than from 16-byte aligned rows
    row = 8 if gs.kv == "int4" else 4
    inline = compile_fn(gs.name, fn, types, {**constexprs, "ROW_ALIGN": row},
                        aligned=("k_ptr", "v_ptr"))  # fmt: skip
    no_narrower(f"{gs.name} {constexprs}", aligned, inline, row, "LDG")
    compile_ones(gs.name, fn, types, {**constexprs, "ROW_ALIGN": 16})

# The portable int4 lookup takes four codes an asm (pack 4): a tile with fewer codes a thread
# than that (16-channel heads, 16-key tiles, 8 warps: one code a thread) must still compile
# (Triton pads the asm's operands with undefined values and drops their results)
gs = GQADecodeSpec(16, 16, "bf16", "int4", 16, "portable", "sm90", "gpu")
types = {"q_ptr": "*bf16", "k_ptr": "*u8", "v_ptr": "*u8", "ks_ptr": "*fp16", "vs_ptr": "*fp16"}
types |= {"block_table_ptr": "*i32", "seqlens_ptr": "*i32", "o_acc_ptr": "*fp32"}
types |= {"lse_acc_ptr": "*fp32", "scale_log2": "fp32"}
constexprs = {"CAUSAL": False, "BLOCK_H": 16, "BLOCK_N": 16, "NUM_STAGES": 2, "TILE_IN_PAGE": False}
constexprs |= {"PAGE_POW2": True, "TABLE_BLOCK": 64, "ROW_ALIGN": 16}
compile_fn(f"{gs.name} (8 warps, 16-key tiles)", load(gs).split_kernel, types, constexprs, 8)

# The GQA decode's Hopper variant (rows: Gluon, integer / fp8 MMAs): each format, both query
# dtypes, groups that take an N of 8 and of 16 (one not a power of two), two to four tiles in
# flight; rows at multiples of 16 bytes (the caches and their block, row and head strides passed
# as multiples of 16) and vLLM's 132-byte rows (4-byte aligned: nothing specialised), whose K
# and V must still come by cp.async (4-byte LDGSTS), not a byte a load; one query a sequence
# and several (speculative decoding: 2 and 4 queries, causal or not).
for gs, group, bufs, row_align in (
    (GQADecodeSpec(128, 128, "bf16", "int8", 0, "rows", "sm90", "gpu"), 4, 3, 16),
    (GQADecodeSpec(128, 128, "fp16", "int8", 0, "rows", "sm90", "gpu"), 16, 2, 16),
    (GQADecodeSpec(128, 128, "bf16", "fp8e4m3", 0, "rows", "sm90", "gpu"), 8, 4, 16),
    (GQADecodeSpec(128, 128, "bf16", "fp8e4m3", 0, "rows", "sm90", "gpu"), 13, 2, 16),
    (GQADecodeSpec(128, 128, "bf16", "int8", 0, "rows", "sm90", "gpu"), 8, 2, 4),
    (GQADecodeSpec(128, 128, "bf16", "fp8e4m3", 0, "rows", "sm90", "gpu"), 16, 3, 4),
    # fp8 e5m2: e5m2 x e4m3 MMAs for PV
    (GQADecodeSpec(128, 128, "bf16", "fp8e5m2", 0, "rows", "sm90", "gpu"), 8, 2, 16),
    (GQADecodeSpec(128, 128, "fp16", "fp8e5m2", 0, "rows", "sm90", "gpu"), 4, 3, 4),
    # int4: each scale group the kernel reads, vLLM's 72-byte rows (group 32: 8-aligned) and
    # 68-byte rows (group 64: 4-aligned)
    (GQADecodeSpec(128, 128, "bf16", "int4", 32, "rows", "sm90", "gpu"), 4, 2, 16),
    (GQADecodeSpec(128, 128, "fp16", "int4", 64, "rows", "sm90", "gpu"), 8, 3, 16),
    (GQADecodeSpec(128, 128, "bf16", "int4", 128, "rows", "sm90", "gpu"), 13, 2, 16),
    (GQADecodeSpec(128, 128, "bf16", "int4", 32, "rows", "sm90", "gpu"), 16, 4, 8),
    (GQADecodeSpec(128, 128, "bf16", "int4", 64, "rows", "sm90", "gpu"), 8, 2, 4),
):
    types = {"q_ptr": PTR[gs.dtype], "k_ptr": GQA_CACHE[gs.kv], "v_ptr": GQA_CACHE[gs.kv]}
    scale = "*fp16" if gs.kv == "int4" else "*fp32"
    types |= {"ks_ptr": scale, "vs_ptr": scale, "block_table_ptr": "*i32"}
    types |= {"seqlens_ptr": "*i32", "o_acc_ptr": "*fp32", "lse_acc_ptr": "*fp32"}
    types["scale_log2"] = "fp32"
    fn = load(gs).split_kernel
    strides = [n for n in fn.arg_names if n.startswith(("stride_k_", "stride_v_"))]
    aligned = ("k_ptr", "v_ptr", *strides) if row_align == 16 else ()
    # speculative decoding's queries (SQ x G query rows, causal) where they fit N 16
    sq, causal = (4, True) if group == 4 else (2, False) if group == 8 else (1, False)
    n = load(gs).mma_n(sq * group)
    constexprs = {"G": group, "N": n, "NUM_BUF": bufs, "ROW_ALIGN": row_align, "SQ": sq,
                  "CAUSAL": causal}  # fmt: skip
    kernel = compile_fn(f"{gs.name} rows at {row_align} bytes", fn, types, constexprs,
                        aligned=aligned)  # fmt: skip
    if (gs.kv, group) in (("int8", 4), ("fp8e4m3", 8), ("fp8e5m2", 8), ("int4", 4)):
        compile_ones(gs.name, fn, types, constexprs)
    if kernel is not None:
        code = sass(kernel)
        copies, byte_loads = len(re.findall(r"\bLDGSTS\b", code)), code.count("LDG.E.U8")
        if not copies or byte_loads:
            failures += 1
            print(f"FAIL {gs.name} rows at {row_align} bytes: {copies} cp.async (LDGSTS), "
                  f"{byte_loads} one-byte loads")  # fmt: skip

# The MLA decode's Hopper rows variants (Gluon: the keys as the MMAs' rows) over fp8_ds_mla and
# MXFP4 (group 32, with and without the RoPE part): N of 16 and 8, two and three pages in
# flight, and fp8_ds_mla's wide kernel (8 warps, two pages a tile) at N 32 and 16; each kernel
# and its TMA descriptors as the launcher picks them (``kernel_for``), the descriptors typed
# with their shared layouts
ROWS_MLA = MLADecodeDSMLASpec(576, 512, "bf16", "rows", "sm90", "gpu")
TENSORDESC = {torch.float8_e4m3fn: "fp8e4nv", torch.float32: "fp32", torch.bfloat16: "bf16"}
TENSORDESC[torch.uint8] = "u8"
for rows_spec in (
    ROWS_MLA,
    MLADecodeMXFP4Spec(576, 512, "bf16", "rows", "sm90", "gpu"),
    MLADecodeMXFP4Spec(512, 512, "bf16", "rows", "sm90", "gpu"),
):
    rows_mod = load(rows_spec)
    rows_cache = torch.zeros(4, 64, 1, rows_mod.ROW_BYTES, dtype=torch.uint8)
    cases = [(16, 2, True, 1), (5, 3, False, 1)]
    if rows_mod.UNOFFERED_MAX_HEADS > 16:  # (heads, pages in flight, ordered, pages a tile)
        cases += [(rows_mod.UNOFFERED_MAX_HEADS, 2, True, 2), (16, 2, False, 2)]
    for heads, bufs, ordered, pages in cases:
        n = rows_mod.mma_n(heads)
        rows_kernel, _, warps, rows_descs = rows_mod.kernel_for(n, rows_cache, pages)
        types = {
            "q_ptr": "*bf16",
            "block_table_ptr": "*i32",
            "seqlens_ptr": "*i32",
            "order_ptr": "*i32",
        }
        types |= {"o_acc_ptr": "*fp32", "lse_acc_ptr": "*fp32", "scale_log2": "fp32"}
        names = ("codes_desc", "scale_desc", "rope_desc")[: len(rows_descs)]
        for arg, d in zip(names, rows_descs, strict=True):
            box = ", ".join(map(str, d.block_shape))
            types[arg] = f"tensordesc<{TENSORDESC[d.base.dtype]}[{box}],{d.layout!r}>"
        constexprs = {"N": n, "NUM_BUF": bufs, "ORDERED": ordered}
        label = rows_spec.name + (" wide" if pages == 2 else "")
        kernel = compile_fn(label, rows_kernel, types, constexprs, warps)
        if ordered:
            compile_ones(label, rows_kernel, types, constexprs, warps)
        if kernel is not None:
            used = [m["block_size"] for m in kernel.metadata.tensordesc_meta]
            if used != [d.block_shape for d in rows_descs]:
                failures += 1
                boxes = [d.block_shape for d in rows_descs]
                print(f"FAIL {rows_spec.name}: descriptor boxes {boxes}, the kernel reads {used}")
rows_mod = load(ROWS_MLA)
order_types = {"seqlens_ptr": "*i32", "order_ptr": "*i32"}
for block in (16, rows_mod.ORDER_BLOCK):  # (the rows launcher's longest-first order)
    compile_fn(ROWS_MLA.name + " order", rows_mod.order_kernel, order_types,
               {"BLOCK": block, "CHUNK": 16})  # fmt: skip

# What the wgmma decode's launcher passes as multiples of 16 (Q is copied where it is not)
WGMMA_ALIGNED = (
    "k_ptr",
    "stride_k_block",
    "stride_k_row",
    "stride_k_head",
    "q_ptr",
    "stride_q_batch",
    "stride_q_row",
)

# The wgmma decode over quantized caches: the loader partition stages the rows' bytes and
# dequantizes them; the rows' bytes by TMA (one descriptor a part of the row, typed with its
# shared layout) or by cp.async (the descriptor arguments are then the cache itself, unused)
TORCH_TO_TRITON = {"int32": "i32", "float32": "fp32", "bfloat16": "bf16", "uint8": "u8"}
for ds, bn, bufs, in_page, tma in (
    (MLADecodeFP8Spec(576, 512, "bf16", "wgmma"), 32, 2, True, True),
    (MLADecodeFP8Spec(576, 512, "bf16", "wgmma"), 32, 2, True, False),
    (MLADecodeFP8Spec(576, 512, "fp16", "wgmma"), 16, 4, False, False),
    (MLADecodeDSMLASpec(576, 512, "bf16", "wgmma"), 32, 2, True, True),
    (MLADecodeDSMLASpec(576, 512, "bf16", "wgmma"), 32, 2, False, False),
    (MLADecodeMXFP4Spec(576, 512, "bf16", "wgmma"), 32, 2, True, True),
    (MLADecodeMXFP4Spec(576, 512, "bf16", "wgmma"), 32, 2, True, False),
    (MLADecodeMXFP4Spec(512, 512, "bf16", "wgmma"), 16, 4, True, True),
    (MLADecodeMXFP4Spec(512, 512, "bf16", "wgmma", group=16), 16, 4, False, False),
    (MLADecodeMXFP4Spec(576, 512, "bf16", "wgmma", group=64), 64, 1, True, False),
):
    mod = load(ds)
    dt = PTR[ds.dtype]
    types = {n: "*i32" for n in ("block_table_ptr", "seqlens_ptr", "meta_ptr", "num_splits_ptr")}
    types |= {"q_ptr": dt, "out_ptr": dt, "k_ptr": "*u8"}
    types |= {"o_acc_ptr": "*fp32", "lse_acc_ptr": "*fp32", "lse_ptr": "*fp32"}
    types |= {"k_scale_ptr": "*fp32", "scale_log2": "fp32"}
    descs = {}
    for name, _, dtype, box in getattr(mod, "RAW_PARTS", ()) if tma else ():
        layout = mod.RAW_LAYOUTS[name](bn)
        shape = ", ".join(map(str, (bn, *box)))
        descs[name] = f"tensordesc<{TORCH_TO_TRITON[str(dtype)[6:]]}[{shape}],{layout!r}>"
    for part in ("lat", "scale", "rope"):  # (a part the format lacks: the latent descriptor)
        types[f"k_{part}_desc"] = descs.get(part, descs.get("lat", "*u8"))
    constexprs = {
        # (tiles in a page, not causal: the loader's NaN keys mark a missing page, and the S
        # warpgroup does not check the table)
        "CAUSAL": not in_page or bufs == 1,
        "BLOCK_N": bn,
        "NUM_BUF": bufs,
        "TILE_IN_PAGE": in_page,
        "USE_TMA": tma,
        "ONE_KV_HEAD": in_page,  # several KV heads where not
        "FEWEST_BUFFERS": bufs == 1,
    }
    kernel = compile_fn(ds.name + " roles", mod.split_kernel_roles, types, constexprs, warps=4,
                        maxnreg=mod.ROLES_MAXNREG, aligned=WGMMA_ALIGNED)  # fmt: skip
    if not tma and bn == 32:
        compile_ones(ds.name + " roles", mod.split_kernel_roles, types, constexprs, warps=4,
                     maxnreg=mod.ROLES_MAXNREG, aligned=WGMMA_ALIGNED)  # fmt: skip
    if kernel is not None and tma:
        # The launcher encodes the i-th descriptor argument with the box the compiled kernel
        # reads through it: the launcher's descriptors must come in the same order.
        cache = torch.zeros(4, 64, 1, mod.RAW_ROW_BYTES.value, dtype=torch.uint8)
        boxes = [d.block_shape for d in mod.raw_descriptors(cache, bn)]
        used = [m["block_size"] for m in kernel.metadata.tensordesc_meta]
        if boxes != used:
            failures += 1
            print(f"FAIL {ds.name}: descriptor boxes {boxes}, the kernel reads {used}")

for spec in (
    MLADecodeSpec(576, 512, "bf16"),
    MLADecodeSpec(288, 256, "fp16"),
    MLADecodeSpec(576, 512, "bf16", "wgmma"),
    MLADecodeSpec(512, 512, "fp16", "wgmma"),
    MLADecodeSpec(288, 256, "bf16", "wgmma"),
):
    mod = load(spec)
    dt = PTR[spec.dtype]
    types = {
        "q_ptr": dt,
        "k_ptr": dt,
        "block_table_ptr": "*i32",
        "seqlens_ptr": "*i32",
        "meta_ptr": "*i32",
        "num_splits_ptr": "*i32",
        "o_acc_ptr": "*fp32",
        "lse_acc_ptr": "*fp32",
        "out_ptr": dt,
        "lse_ptr": "*fp32",
        "scale_log2": "fp32",
    }
    if spec.variant == "wgmma":  # Gluon: 64 rows, 16-64 keys a tile
        # three 4-warp partitions (warp_specialize), registers set per partition
        # K tiles by TMA (descriptors typed with their shared layouts, as Gluon's are) or by
        # cp.async (the descriptor arguments are then the cache itself, unused)
        for bn, bufs, in_page, tma in (
            (64, 2, True, True),
            (64, 2, True, False),
            (32, 4, False, False),
        ):
            rope = spec.head_dim - spec.head_dim_v
            for arg, width in (("k_lat_desc", spec.head_dim_v), ("k_rope_desc", rope)):
                width = width or spec.head_dim_v  # (no rope: the latent descriptor twice)
                layout = gl.NVMMASharedLayout.get_default_for([bn, width], GL[spec.dtype])
                types[arg] = f"tensordesc<{spec.dtype}[{bn}, {width}],{layout!r}>" if tma else dt
            constexprs = {
                "CAUSAL": bn == 32,
                "BLOCK_N": bn,
                "NUM_BUF": bufs,
                "TILE_IN_PAGE": in_page,
                "USE_TMA": tma,
                "ONE_KV_HEAD": tma or bn == 32,  # several KV heads: cp.async only
                "FEWEST_BUFFERS": bufs == 1,
            }
            compile_fn(spec.name + " roles", mod.split_kernel_roles, types, constexprs, warps=4,
                       maxnreg=mod.ROLES_MAXNREG, aligned=WGMMA_ALIGNED)  # fmt: skip
            if bn == 32 and spec.head_dim == 576:
                compile_ones(spec.name + " roles", mod.split_kernel_roles, types, constexprs,
                             warps=4, maxnreg=mod.ROLES_MAXNREG, aligned=WGMMA_ALIGNED)  # fmt: skip
    for bh, bn in ((16, 32), (64, 64)) if spec.variant != "wgmma" else ():
        constexprs = {
            "CAUSAL": True,
            "BLOCK_H": bh,
            "BLOCK_N": bn,
            "NUM_STAGES": 2,
            "PAGE_AHEAD": bh == 16,
            "TILE_IN_PAGE": bh == 64,
            "ONE_KV_HEAD": bh == 16,
        }
        compile_fn(spec.name, mod.split_kernel, types, constexprs)
        compile_ones(spec.name, mod.split_kernel, types, constexprs)
    combine_types = {
        "o_acc_ptr": "*fp32",
        "lse_acc_ptr": "*fp32",
        "num_splits_ptr": "*i32",
        "out_ptr": dt,
        "lse_ptr": "*fp32",
    }
    for one_kv_head in (True, False):
        constexprs = {"BLOCK_H": 16, "BLOCK_V": 128, "ONE_KV_HEAD": one_kv_head}
        compile_fn(spec.name, mod.combine_kernel, combine_types, constexprs)
    compile_ones(spec.name, mod.combine_kernel, combine_types, constexprs)

# A kernel argument computed from host tuning parameters (the [host] params of a template's
# space: one compile serves all of their values, which the tuner's compile pool relies on) is
# not specialised, or each of its values' classes (1, a multiple of 16, other) is a binary of
# its own: the pieces a sequence is cut into, from split_factor and piece_tiles.
for spec in (
    GQADecodeSpec(128, 128, "bf16", "int8", 0, "portable", "sm90", "gpu"),
    GQADecodeSpec(128, 128, "bf16", "int4", 32, "portable", "sm90", "gpu"),
    GQADecodeSpec(128, 128, "fp16", "fp8e4m3", 0, "rows", "sm90", "gpu"),
    GQADecodeSpec(128, 128, "bf16", "int4", 32, "rows", "sm90", "gpu"),
    MLADecodeDSMLASpec(576, 512, "bf16", "rows", "sm90", "gpu"),
):
    mod = load(spec)
    for kernel in (mod.split_kernel, mod.combine_kernel):
        # (the GQA rows kernel's kv_heads alike: one binary for every model's KV head count)
        for arg in ("splits", "kv_heads"):
            if arg not in kernel.arg_names:
                continue
            param = kernel.params[kernel.arg_names.index(arg)]
            if param.do_not_specialize:
                print(f"ok   {spec.name} {kernel.fn.__name__}: {arg} not specialised")
            else:
                failures += 1
                print(f"FAIL {spec.name} {kernel.fn.__name__}: {arg} is specialised "
                      "(1 / 16 / other)")  # fmt: skip

# kvgen bench's store floor (the stores' bytes between the same addresses, no format arithmetic):
# it must move bytes at the widest the layout allows, or it is no floor: the input by 16-byte
# loads, the rows by 16-byte stores on caches whose strides are multiples of 16 bytes, by 4-byte
# ones (never narrower) on vLLM's 132-byte rows.
from kvgen.bench._floor_kernel import scatter_rows_kernel, warps_for  # noqa: E402

floor_types = {"src_ptr": "*bf16", "slot_ptr": "*i64", "dst_ptr": "*u8", "aux_ptr": "*fp32"}
floor = {"IN_W": 64, "HEADS_P": 8, "OUT_P": 32, "AUX_P": 1}
for label, constexprs, aligned, want in (
    ("floor separate int8 8x128", {**floor, "OUT_W": 32, "AUX_W": 1},
     ("src_ptr", "dst_ptr", "aux_ptr", "d_block", "d_slot", "d_head", "a_block", "a_slot"),
     "STG.E.128"),
    ("floor inline int8 8x128", {**floor, "OUT_W": 33, "AUX_W": 0, "OUT_P": 64}, ("src_ptr",),
     "STG.E "),
):  # fmt: skip
    warps = warps_for(constexprs["HEADS_P"] * constexprs["OUT_P"])
    kernel = compile_fn(label, scatter_rows_kernel, floor_types, constexprs, warps, aligned)
    if kernel is not None:
        text = sass(kernel)
        narrow = len(re.findall(r"STG\.E\.(?:U8|S8|U16|S16)", text))
        ok = want in text and "LDG.E.128" in text and not narrow
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {label}: loads by LDG.E.128, stores by "
              f"{want.strip()}, {narrow} narrower")  # fmt: skip

# benchmarks/tma_inline_rows.py: TMA boxes of vLLM's 132-byte inline rows at their own columns
from _scripts import benchmark_script  # noqa: E402

tma_rows = benchmark_script("tma_inline_rows")

box_types = {"desc": f"tensordesc<u8[16, 128],{tma_rows.LAYOUT!r}>"}
box_types["tail_desc"] = f"tensordesc<u8[16, {tma_rows.TAIL}],{tma_rows.LAYOUT!r}>"
compile_fn("tma_inline_rows boxes", tma_rows.boxes_kernel, {**box_types, "out_ptr": "*u8"},
           {"PAGE": 16, "BOX": tma_rows.BOX, "ROW": tma_rows.ROW, "ALIGN": 16})  # fmt: skip
compile_fn("tma_inline_rows read", tma_rows.read_kernel, {**box_types, "sums_ptr": "*i32"},
           {"PAGE": 16, "ROW": tma_rows.ROW, "STAGES": 4})  # fmt: skip

sys.exit(1 if failures else 0)
