"""The MLA decode cache references (kvgen.formats.mla_cache) against docs/formats.md's byte
definitions: layouts, scale rules, exactness in bf16 and the non-finite rules."""

import math

import torch

from kvgen.formats import mla_cache, mxfp4


def _data(n=6, latent=512, rope=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv_c = torch.randn(n, latent, generator=gen)
    kv_c[:, 7] *= 40.0  # an outlier channel
    kv_c[1, :128] = 0.0  # an all-zero tile
    kv_c[2, 128:256] *= 2.0**-20  # a tiny tile (subnormal codes)
    return kv_c.to(torch.bfloat16), torch.randn(n, rope, generator=gen).to(torch.bfloat16)


def test_fp8_ds_mla_layout_and_scales():
    kv_c, k_pe = _data()
    rows = mla_cache.quantize_fp8_ds_mla(kv_c, k_pe)
    assert rows.shape == (6, 656) and rows.dtype == torch.uint8
    assert mla_cache.ds_mla_row_bytes() == 656
    scales = rows[:, 512:528].contiguous().view(torch.float32)  # four little-endian fp32
    amax = kv_c.float().reshape(6, 4, 128).abs().amax(-1)
    q = torch.clamp(amax / 448.0, min=1e-4)
    # a power of two, the least one at or above q
    assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)
    assert (scales >= q).all() and (scales < 2 * q).all()
    assert float(scales[1, 0]) == 2.0 ** math.ceil(math.log2(float(torch.tensor(1e-4))))
    # the RoPE part: the bf16 bits as they came
    assert torch.equal(rows[:, 528:], k_pe.contiguous().view(torch.uint8).reshape(6, 128))
    # codes: e4m3fn of x / scale, exactly (x * 2^-E is exact)
    want = (kv_c.float().reshape(6, 4, 128) / scales[..., None]).to(torch.float8_e4m3fn)
    assert torch.equal(rows[:, :512], want.reshape(6, 512).view(torch.uint8))


def test_fp8_ds_mla_dequantizes_exactly_in_bf16():
    kv_c, k_pe = _data(seed=1)
    back = mla_cache.dequantize_fp8_ds_mla(mla_cache.quantize_fp8_ds_mla(kv_c, k_pe))
    assert back.shape == (6, 576)
    assert torch.equal(back.to(torch.bfloat16).float(), back)  # power-of-two scales: exact
    assert torch.equal(back[:, 512:], k_pe.float())
    err = (back[:, :512] - kv_c.float()).abs()
    scale = torch.repeat_interleave(
        mla_cache.quantize_fp8_ds_mla(kv_c, k_pe)[:, 512:528].contiguous().view(torch.float32),
        128,
        dim=1,
    )
    # e4m3fn: 3 mantissa bits (half an ulp: 2^-4 relative), subnormal step 2^-9 of the scale
    assert (err <= torch.maximum(kv_c.float().abs() * 2.0**-4, scale * 2.0**-10)).all()


def test_fp8_ds_mla_non_finite_tile_is_nan_and_others_are_kept():
    kv_c, k_pe = _data(seed=2)
    bad = kv_c.clone()
    bad[3, 300] = float("nan")
    bad[4, 10] = float("inf")
    rows = mla_cache.quantize_fp8_ds_mla(bad, k_pe)
    good = mla_cache.quantize_fp8_ds_mla(kv_c, k_pe)
    scales = rows[:, 512:528].contiguous().view(torch.float32)
    assert math.isnan(scales[3, 2]) and math.isnan(scales[4, 0])
    assert (rows[3, 256:384] == 0).all() and (rows[4, :128] == 0).all()
    back = mla_cache.dequantize_fp8_ds_mla(rows)
    assert back[3, 256:384].isnan().all() and back[4, :128].isnan().all()
    # every other tile and row: the same bytes as without the non-finite element
    keep = torch.ones(6, 656, dtype=torch.bool)
    keep[3, 256:384] = keep[4, :128] = False
    keep[3, 520:524] = keep[4, 512:516] = False
    assert torch.equal(rows[keep], good[keep])


def test_fp8_per_tensor():
    kv_c, k_pe = _data(seed=3)
    k_scale = torch.tensor([0.02])
    rows = mla_cache.quantize_fp8_per_tensor(kv_c, k_pe, k_scale)
    assert rows.shape == (6, 576)
    x = torch.cat([kv_c.float(), k_pe.float()], 1)
    want = (x / 0.02).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(rows, want)
    back = mla_cache.dequantize_fp8_per_tensor(rows, k_scale)
    assert torch.equal(back, want.view(torch.float8_e4m3fn).float() * 0.02)
    # non-finite elements: the NaN code with the element's sign; 1e6 / 0.02 saturates at 448
    odd = kv_c.float().clone()
    odd[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e6])
    codes = mla_cache.quantize_fp8_per_tensor(odd, k_pe, k_scale)[0, :4].tolist()
    assert codes == [0x7F, 0x7F, 0xFF, 0x7E]


def test_mxfp4_with_rope_starts_with_the_rope_free_row():
    kv_c, k_pe = _data(seed=4)
    rows = mla_cache.quantize_mxfp4_rope(kv_c, k_pe)
    assert rows.shape == (6, 400) and mla_cache.mxfp4_rope_row_bytes() == 400
    assert torch.equal(rows[:, :272], mxfp4.quantize_rows(kv_c, 32))
    back = mla_cache.dequantize_mxfp4_rope(rows)
    assert torch.equal(back[:, :512], mxfp4.dequantize_rows(rows[:, :272], 512, 32))
    assert torch.equal(back[:, 512:], k_pe.float())
    assert torch.equal(back.to(torch.bfloat16).float(), back)


def test_rope_of_wider_inputs_rounds_to_nearest_even():
    x = torch.tensor([[1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8]])  # ties between bf16 neighbours
    assert mla_cache.rope_bf16(x).float().tolist() == [[1.0, 1.0 + 2.0**-6]]
