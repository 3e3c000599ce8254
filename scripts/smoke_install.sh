#!/usr/bin/env bash
# A new user's first minutes: a fresh venv outside the checkout, `pip install torch triton .`
# (no extras), then one MXFP4 cache stored and read back under Triton's CPU interpreter, run from
# another folder so that only the installed package is used.
set -euo pipefail
cd "$(dirname "$0")/.."
here=$PWD
venv=$(mktemp -d)/venv
PY=${PYTHON:-python3}
"$PY" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "torch==${KVGEN_TORCH_VERSION:-2.13.0}" \
  "triton==${KVGEN_TRITON_VERSION:-3.6.0}" "$here"
cd "$(dirname "$venv")"
TRITON_INTERPRET=1 "$venv/bin/python" - <<'PY'
import torch

import kvgen
from kvgen.ops import gather_mxfp4_mla, mxfp4_row_bytes, store_mxfp4_mla

x = torch.randn(4, 512).to(torch.bfloat16)
cache = torch.zeros(2, 16, mxfp4_row_bytes(512), dtype=torch.uint8)
slots = torch.tensor([0, 5, 17, 31])
store_mxfp4_mla(x, slots, cache)
y = gather_mxfp4_mla(cache, slots, 512)
err = float((y.float() - x.float()).norm() / x.float().norm())
assert err < 0.2, err
print(f"kvgen {kvgen.__version__} from a fresh venv: MXFP4 store + gather, relative error {err:.3f}")
PY
rm -rf "$(dirname "$venv")"
