"""Whether the int4 rows decode could form S from one f16 term of K's levels (CPU, float64).

The rows kernel (templates/gqa_decode_rows.py.j2) multiplies q by K's levels as two f16 terms,
hi (the level rounded to f16) and lo (what that leaves), in two MMAs; the f16 products are
exact and accumulate in fp32, so what one term would change is K's level rounded to f16. This
runs the float64 reference decode (``kvgen.formats.gqa_decode``) over K with its levels so
rounded and over the exact dequantized cache, written by the format's reference store (group
32, 8 KV heads x 128, 4 query heads a KV head, 4 x 1024 keys), and prints the relative error of
out and the largest error of lse between them, for queries of standard deviation 1, 2, 4 and
keys with and without four outlier channels (x10). The decode's contract: lse within 1e-3.

    python benchmarks/int4_k_terms.py
"""

import torch

from kvgen.families.gqa_decode.verify import make_caches
from kvgen.formats.gqa_decode import gqa_decode

GROUP, HEAD, H_KV, G, PAGE = 32, 128, 8, 4, 16


def one_term_error(q_std: float, outlier: float, seed: int, batch: int = 4, seqlen: int = 1024):
    """(relative error of out, largest error of lse) of the decode with K's levels in f16."""
    gen = torch.Generator().manual_seed(seed)
    n = batch * seqlen
    keys = torch.randn(n, H_KV, HEAD, generator=gen)
    if outlier:
        keys[..., torch.randperm(HEAD, generator=gen)[:4]] *= outlier
    values = torch.randn(n, H_KV, HEAD, generator=gen)
    _, _, ks, _, k_deq, v_deq = make_caches("int4", GROUP, keys, values, PAGE, "cpu",
                                            writer="reference")  # fmt: skip
    scale = ks.double().repeat_interleave(GROUP, dim=-1)  # each channel's group scale
    level = k_deq.double().abs() / torch.where(scale > 0, scale, 1.0)
    k_one = torch.sign(k_deq.double()) * level.to(torch.float16).double() * scale
    q = (torch.randn(batch, 1, H_KV * G, HEAD, generator=gen) * q_std).to(torch.bfloat16)
    table = torch.arange(n // PAGE, dtype=torch.int32).reshape(batch, -1)
    lengths = torch.full((batch,), seqlen, dtype=torch.int32)
    out, lse = gqa_decode(q.double(), k_deq.double(), v_deq.double(), table, lengths)
    out1, lse1 = gqa_decode(q.double(), k_one, v_deq.double(), table, lengths)
    return float((out1 - out).norm() / out.norm()), float((lse1 - lse).abs().max())


def main() -> None:
    for q_std in (1.0, 2.0, 4.0):
        for outlier in (0.0, 10.0):
            for seed in (0, 1):
                rel, lse = one_term_error(q_std, outlier, seed)
                print(f"q std {q_std:.0f}, outlier channels x{outlier:.0f}, seed {seed}: "
                      f"out {rel:.2e}, lse {lse:.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
