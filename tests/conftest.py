import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# No GPU: run the generated kernels in Triton's CPU interpreter. Must be set before any
# generated module is imported (triton.jit picks the interpreter at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests' shared helpers (_fuzz.py) import as top-level modules: --import-mode=importlib puts
# no test folder on sys.path by itself.
sys.path.insert(0, str(Path(__file__).parent))
# A fresh module cache per test session, so the generator itself is exercised every run.
os.environ.setdefault("KVGEN_CACHE_DIR", tempfile.mkdtemp(prefix="kvgen-test-cache-"))


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def local_target():
    from kvgen.runtime import local_target

    return local_target()
