"""The format objects (kvgen.formats): their facts agree with the references and the byte
definitions, the families and templates take their arithmetic from them, and the accuracy
table is built from them."""

from __future__ import annotations

import pytest
import torch

from kvgen import formats, registry
from kvgen.codegen.render import template_path
from kvgen.formats import mxfp4, per_token_head
from kvgen.verify import accuracy_table


def test_row_bytes_follow_the_byte_definitions():
    # MXFP4: latent / 2 element bytes, then latent / group scale bytes in the same row
    assert formats.MXFP4.row_bytes(512, 32) == 256 + 16 == mxfp4.row_bytes(512, 32)
    assert formats.MXFP4.row_bytes(448, 16) == 224 + 28
    # per-token-head: the codes only (the scales have their own cache); int4 packs two a byte
    assert formats.INT8.row_bytes(576) == 576
    assert formats.FP8_E5M2.row_bytes(80) == 80
    assert formats.INT4.row_bytes(81, 32) == 41
    assert formats.INT4.scales_per_row(81, 32) == 3
    assert formats.INT8.scales_per_row(128) == 1


def test_scale_facts():
    assert formats.INT8.scale_dtype == torch.float32
    assert formats.INT4.scale_dtype == torch.float16
    assert formats.MXFP4.scale_dtype == torch.uint8
    assert formats.MXFP4.scale_placement == formats.ROW_TAIL
    assert formats.INT4.scale_placement == formats.OWN_CACHE


@pytest.mark.parametrize("name", list(formats.FORMATS))
def test_quantize_is_the_reference(name):
    fmt = formats.get(name)
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(1))
    codes, scales = fmt.quantize(x)
    if name == "mxfp4":
        rows = mxfp4.quantize_rows(x.reshape(-1, 64), 32)
        assert torch.equal(codes.reshape(-1, 32), rows[:, :32])
        assert torch.equal(scales.reshape(-1, 2), rows[:, 32:])
    elif name == "int4":
        want = per_token_head.quantize_int4(x, 32)
        assert torch.equal(codes, want[0]) and torch.equal(scales, want[1])
    else:
        want = per_token_head.quantize_per_token_head(x, fmt.code_dtype)
        assert torch.equal(codes.view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(scales, want[1])
    assert codes.dtype == fmt.code_dtype
    assert codes.shape[-1] == fmt.code_bytes(64)
    per_row = (fmt.scales_per_row(64),) if fmt.groups else ()  # one scale a row: no last axis
    assert scales.shape == x.shape[:-1] + per_row
    back = fmt.roundtrip(x)
    assert back.shape == x.shape
    # every format keeps a value within half its coarsest step of the row's (group's) peak
    assert float((back - x).abs().max()) < 0.35 * float(x.abs().max())


def test_bad_format_and_group():
    with pytest.raises(ValueError, match="unknown KV format 'fp4'"):
        formats.get("fp4")
    with pytest.raises(ValueError, match="group must be one of"):
        formats.MXFP4.row_bytes(512, 48)


def test_every_quantizing_template_takes_its_format_macros():
    """Each store / reader spec names its format's macro file, which exists, and the
    template imports it: the format's arithmetic is written once, in the format's macros."""
    seen = set()
    for spec in registry.variants("sm90", "interp"):
        ctx = spec.context()
        if "format_macros" not in ctx:
            continue
        macros = ctx["format_macros"]
        assert macros in {f.macros for f in formats.FORMATS.values()}
        assert template_path(macros).is_file()
        assert "import format_macros as codec" in template_path(spec.template).read_text()
        seen.add(macros)
    assert seen == {f.macros for f in formats.FORMATS.values()}


def test_accuracy_table_is_the_formats_and_repeatable():
    table = accuracy_table(rows=64, width=128)
    labels = list(dict.fromkeys(r["format"] for r in table))
    assert labels == [label for f in formats.FORMATS.values() for label, _ in f.accuracy_entries()]
    # the same numbers on every call: every data set is drawn from the seeded generator
    assert accuracy_table(rows=64, width=128) == table
