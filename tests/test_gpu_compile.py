"""Generated kernels compile for sm90 through Triton's real GPU pipeline, on any machine.

The interpreter accepts things the GPU compiler refuses (plain module globals, some shapes);
this catches them before a GPU run does. The compilation runs in a child process without
TRITON_INTERPRET (triton.jit decides at import time).
"""

import os
import subprocess
import sys
from pathlib import Path


def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["KVGEN_CACHE_DIR"] = str(tmp_path)  # GPU-target modules, fresh
    script = Path(__file__).with_name("_gpu_compile_check.py")
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert result.stdout.count("ok   ") >= 20
