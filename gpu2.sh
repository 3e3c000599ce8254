python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/kv .
export PYTHONPATH=/tmp/kv:/tmp/site PYTHONUNBUFFERED=1
rm -rf /tmp/tc && cp -r tuned_configs /tmp/tc
timeout 150 python3 -P -m kvgen tune --arch sm90 gqa_decode-d128-dv128-fp16-kvint8-g0-rows-sm90-gpu gqa_decode-d128-dv128-fp16-kvfp8e4m3-g0-rows-sm90-gpu --out /tmp/tc --storage /tmp/t.journal 2>&1 | grep -E "^(progress|workers done|wrote|  \[)"
cp /tmp/tc/sm90/gqa_decode.json $OUT/
KVGEN_TUNED_CONFIGS=/tmp/tc timeout 80 python3 -P - <<'PY' 2>&1 | tee $OUT/fp16-check.txt
import torch
from kvgen.bench import gqa_decode as b, harness
from kvgen.ops import flash_attn_with_kvcache
from kvgen.ops._gqa_decode import chosen_spec
from kvgen.verify import compare_attention
for kv in ("int8", "fp8e4m3"):
    for h in (32, 64):
        (q, k, v, ks, vs, t, sl), ref = b.checked_problem(kv, 0, h, "cuda", torch.float16)
        out, lse = flash_attn_with_kvcache(q, k, v, cache_seqlens=sl, block_table=t, return_softmax_lse=True, k_scale_cache=ks, v_scale_cache=vs)
        ok = compare_attention(out, lse, *ref)
        for label, n, keys in b.SHAPES:
            q, k, v, ks, vs, t, sl = b.problem(kv, 0, [keys] * n, h, "cuda", dtype=torch.float16)
            spec = chosen_spec(q, k, v, cache_seqlens=sl, block_table=t, k_scale_cache=ks, v_scale_cache=vs)
            us = harness.graph_time_us(lambda i: flash_attn_with_kvcache(q, k, v, cache_seqlens=sl, block_table=t, k_scale_cache=ks, v_scale_cache=vs), 1)
            print(f"fp16 q {kv} h={h} {label}: {spec.variant} {us:.1f} us check {ok[0]} {ok[1]}")
            del q, k, v
PY
