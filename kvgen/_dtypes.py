"""Short dtype names used in variant names, and their torch dtypes."""

import torch

TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NAME = {v: k for k, v in TORCH.items()}
