"""How far the int4 rows decode's S moves with K's levels as one f16 term (CPU, float64).

The rows kernel (templates/gqa_decode_rows.py.j2) multiplies q by K's levels as one f16 term in
one MMA a scale group: f16(level / INT4_KEY_MU), the multiplier on q's unscale factor
(``kvgen.families.gqa_decode.INT4_KEY_MU``). The f16 products are exact and accumulate in fp32,
so what the term changes is K's level, to mu * f16(level / mu). This runs the float64
reference decode (``kvgen.formats.gqa_decode``) over K with its levels so rounded and over the
exact dequantized cache, written by the format's reference store (group 32, 8 KV heads x 128,
4 query heads a KV head, 4 x 1024 keys), and prints the relative error of out and the largest
error of lse between them, for queries of standard deviation 1, 2, 4 and 8 and keys with and
without four outlier channels (x10): with the kernel's multiplier (mu) and with f16 of the
levels themselves (mu = 1). The decode's contract: lse within 1e-3.

    python benchmarks/int4_k_terms.py
"""

import torch

from kvgen.families.gqa_decode import INT4_KEY_MU
from kvgen.families.gqa_decode.verify import make_caches
from kvgen.formats.gqa_decode import gqa_decode

GROUP, HEAD, H_KV, G, PAGE = 32, 128, 8, 4, 16


def one_term_errors(q_std: float, outlier: float, seed: int, mus: tuple[float, ...],
                    batch: int = 4, seqlen: int = 1024) -> list[tuple[float, float]]:  # fmt: skip
    """For each mu of ``mus``: (relative error of out, largest error of lse) of the decode with
    K's levels as mu * f16(level / mu); the cache and the exact decode made once."""
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
    q = (torch.randn(batch, 1, H_KV * G, HEAD, generator=gen) * q_std).to(torch.bfloat16)
    table = torch.arange(n // PAGE, dtype=torch.int32).reshape(batch, -1)
    lengths = torch.full((batch,), seqlen, dtype=torch.int32)
    out, lse = gqa_decode(q.double(), k_deq.double(), v_deq.double(), table, lengths)
    errors = []
    for mu in mus:
        term = (level / mu).to(torch.float16).double() * mu
        k_one = torch.sign(k_deq.double()) * term * scale
        out1, lse1 = gqa_decode(q.double(), k_one, v_deq.double(), table, lengths)
        errors.append((float((out1 - out).norm() / out.norm()), float((lse1 - lse).abs().max())))
    return errors


def main() -> None:
    print(f"mu = INT4_KEY_MU = {INT4_KEY_MU!r}; f16: mu = 1")
    for q_std in (1.0, 2.0, 4.0, 8.0):
        for outlier in (0.0, 10.0):
            for seed in (0, 1):
                (rel, lse), (rel1, lse1) = one_term_errors(q_std, outlier, seed,
                                                           (INT4_KEY_MU, 1.0))  # fmt: skip
                print(f"q std {q_std:.0f}, outlier channels x{outlier:.0f}, seed {seed}: "
                      f"mu: out {rel:.2e}, lse {lse:.2e}; f16: out {rel1:.2e}, "
                      f"lse {lse1:.2e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
