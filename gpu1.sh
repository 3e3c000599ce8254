export KVGEN_COMMIT=$(cat .commit)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/kv .
export PYTHONPATH=/tmp/kv:/tmp/site PYTHONUNBUFFERED=1
rm -rf /tmp/tc && cp -r tuned_configs /tmp/tc
python3 -P -m kvgen tune --arch sm90 gqa_decode-d128-dv128-bf16-kvint8-g0-rows-sm90-gpu gqa_decode-d128-dv128-bf16-kvfp8e4m3-g0-rows-sm90-gpu --out /tmp/tc --storage /tmp/t.journal 2>&1 | grep -E "^(progress|workers done|wrote|  \[)"
cp /tmp/tc/sm90/gqa_decode.json $OUT/
KVGEN_TUNED_CONFIGS=/tmp/tc python3 -P -m kvgen bench --ops gqa_decode --json $OUT/gqa_decode-bench.json --commit $KVGEN_COMMIT 2>&1 | tail -28
