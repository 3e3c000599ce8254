set -x
export KVGEN_COMMIT=$(cat .commit)
KVGEN_CHECK_SECTIONS=gqa_rows timeout 560 scripts/gpu_session.sh family gqa_decode gqa_decode-d128-dv128-bf16-kvfp8e4m3-g0-rows-sm90-gpu
ls $OUT
