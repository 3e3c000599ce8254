"""The MLA decode's tuning problem checks a candidate against a float64 reference over the pages
its two checked sequences read (``pages_read``), not the whole cache."""

import torch

from kvgen.families.mla_decode.tuning import pages_read
from kvgen.formats.mla_decode import mla_decode


def test_the_pages_read_hold_what_the_whole_cache_holds_for_those_sequences():
    gen = torch.Generator().manual_seed(0)
    page, blocks = 4, 40
    cache = torch.randn(blocks, page, 1, 96, generator=gen)
    lengths = [13, 0, 7, 1]
    table = torch.randperm(blocks, generator=gen)[:16].to(torch.int32).reshape(4, 4)
    table[3, 0] = table[0, 1]  # a page two sequences read
    table[2, 3] = 39  # past the sequence's length: not read
    sl = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(4, 1, 3, 96, generator=gen)

    pages, compact = pages_read(table, sl, page)
    read = {int(table[b, i]) for b, n in enumerate(lengths) for i in range(-(-n // page))}
    assert pages.tolist() == sorted(read) and 39 not in pages.tolist()
    whole = mla_decode(q, cache, table, sl, 64)
    part = mla_decode(q, cache[pages], compact, sl, 64)
    for a, b in zip(whole, part, strict=True):
        assert torch.equal(a, b)


def test_16_key_tiles_of_4_bit_codes_are_out_of_the_portable_decodes_spaces():
    """The portable decodes' spaces leave out 16-key tiles of 4-bit codes under 64-row head
    tiles (wrong results on sm90 in every tuning trial), and only those."""
    from kvgen.families.gqa_decode import GQADecodeSpec
    from kvgen.families.mla_decode import MLADecodeFP8Spec, MLADecodeMXFP4Spec, MLADecodeSpec
    from kvgen.space import load_space

    def small_tiles(spec):
        pts = load_space(spec.template).feasible(spec)
        return {(m["block_h"], m["block_n"]) for m in pts if m["block_n"] == 16}

    assert small_tiles(MLADecodeMXFP4Spec(576, 512, "bf16")) == {(64, 16)}
    for other in (MLADecodeSpec(576, 512, "bf16"), MLADecodeFP8Spec(576, 512, "bf16")):
        assert small_tiles(other) == {(16, 16), (32, 16), (64, 16)}
    assert small_tiles(GQADecodeSpec(kv="int4", group=32)) == set()
    assert small_tiles(GQADecodeSpec(kv="int8")) == {(16, 16), (32, 16), (64, 16)}
