"""The pure-torch MXFP4 reference against values worked out by hand from docs/formats.md."""

import torch

from kvgen.formats import mxfp4


def _one_group(values, group=32):
    x = torch.zeros(1, group)
    x[0, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return x


def _codes(row, latent):
    packed = row[: latent // 2].to(torch.int32)
    return torch.stack([packed & 0xF, packed >> 4], -1).reshape(-1)


def test_row_bytes():
    assert mxfp4.row_bytes(512, 32) == 272
    assert mxfp4.row_bytes(448, 32) == 224 + 14
    assert mxfp4.row_bytes(1024, 64) == 512 + 16


def test_midpoint_ties_go_to_the_smaller_magnitude():
    # Peak 6 -> q = 1 -> E = 0 -> X = 127, v = x.
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x = _one_group([6.0, *mids, *[m + 2**-10 for m in mids]])
    row = mxfp4.quantize_rows(x)[0]
    assert row[16].item() == 127
    codes = _codes(row, 32)
    assert codes[0] == 7
    assert codes[1:8].tolist() == [0, 1, 2, 3, 4, 5, 6]  # on the midpoint: the smaller
    assert codes[8:15].tolist() == [1, 2, 3, 4, 5, 6, 7]  # just above: the larger


def test_signs_negative_zero_and_tiny_negatives():
    x = _one_group([6.0, -0.0, -0.1, 0.1, -6.0, -0.25])
    codes = _codes(mxfp4.quantize_rows(x)[0], 32)
    assert codes[:6].tolist() == [7, 0, 8, 0, 15, 8]


def test_all_zero_group_stores_127():
    x = torch.zeros(1, 64)
    x[0, 32:] = -0.0
    row = mxfp4.quantize_rows(x)[0]
    assert row[32:].tolist() == [127, 127]
    assert row[:32].tolist() == [0] * 32


def test_exponent_is_exact_at_powers_of_two():
    # amax 12 -> q = 2 exactly -> E = 1; a hair more -> E = 2.
    assert mxfp4.quantize_rows(_one_group([12.0]))[0, 16] == 128
    assert mxfp4.quantize_rows(_one_group([12.000001]))[0, 16] == 129
    # amax 7 -> q = 7/6 -> E = 1 -> v = 3.5, a tie -> 3.0 (m = 5)
    row = mxfp4.quantize_rows(_one_group([7.0]))[0]
    assert row[16] == 128 and _codes(row, 32)[0] == 5


def test_extreme_magnitudes():
    big = torch.finfo(torch.float32).max
    assert mxfp4.quantize_rows(_one_group([big]))[0, 16] == 253
    # amax / 6 underflows to 0 but the group is not all zero: X clamps to 1.
    tiny = 2.0**-149
    row = mxfp4.quantize_rows(_one_group([tiny, -tiny]))[0]
    assert row[16] == 1
    assert _codes(row, 32)[:2].tolist() == [0, 8]


def test_packing_low_nibble_first():
    x = _one_group([6.0, 0.5, -1.0, 3.0])
    row = mxfp4.quantize_rows(x)[0]
    assert row[0] == 7 | (1 << 4)
    assert row[1] == 0xA | (5 << 4)


def test_decode_is_the_nearest_grid_value_ties_down():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=gen) * torch.exp2(
        torch.randint(-30, 30, (64, 1), generator=gen)
    )
    rows = mxfp4.quantize_rows(x, 32)
    deq = mxfp4.dequantize_rows(rows, 256, 32)
    scale = torch.exp2(rows[:, 128:].double() - 127).repeat_interleave(32, 1)
    v = (x.double() / scale).abs()
    grid = torch.tensor(mxfp4.E2M1_VALUES, dtype=torch.float64)
    dist = (v[..., None] - grid).abs()
    best = dist.min(-1).values
    chosen = (deq.double() / scale).abs()
    assert torch.allclose((v - chosen).abs(), best)
    # and the peak of every group lands in (3, 6]
    peak = v.reshape(64, -1, 32).amax(-1)
    assert ((peak > 3) & (peak <= 6)).all()


def test_store_and_gather_follow_the_slot_mapping():
    x = torch.randn(5, 64)
    cache = torch.full((3, 2, mxfp4.row_bytes(64, 32)), 0xFF, dtype=torch.uint8)
    slots = torch.tensor([4, -1, 0, 6, 3])
    mxfp4.store(x, slots, cache, 32)
    rows = mxfp4.quantize_rows(x, 32)
    assert torch.equal(cache[2, 0], rows[0])
    assert torch.equal(cache[0, 0], rows[2])
    assert torch.equal(cache[1, 1], rows[4])
    assert (cache[0, 1] == 0xFF).all() and (cache[1, 0] == 0xFF).all()
    out = mxfp4.gather(cache, slots, 64, 32)
    assert torch.equal(out[0], mxfp4.dequantize_rows(rows[:1], 64, 32)[0])
    assert (out[1] == 0).all() and (out[3] == 0).all()
