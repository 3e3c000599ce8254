"""Run scripts/gpu_check.py's ``quantized_decodes`` section over and over (fresh random data
each time) for a given number of seconds, printing each failed check with its iteration, then
the count. Several of these side by side load the GPU the way a sanitizer run with other
processes did when one fp8_ds_mla check failed once.

    python scripts/stress_quantized_decodes.py SECONDS
"""

import contextlib
import importlib.util
import io
import sys
import time
from pathlib import Path

spec = importlib.util.spec_from_file_location("gpu_check", Path(__file__).with_name("gpu_check.py"))
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)

end = time.time() + float(sys.argv[1])
n = 0
while time.time() < end:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        gpu_check.quantized_decodes()
    n += 1
    for line in out.getvalue().splitlines():
        if line.startswith("FAIL"):
            print(f"iteration {n}: {line}", flush=True)
print(f"iterations {n}, failed checks {len(gpu_check.failures)}", flush=True)
