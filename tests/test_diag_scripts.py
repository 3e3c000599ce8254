"""The stage-left-out diagnostics (benchmarks/diag_quant_decode.py, diag_gqa_rows.py) patch the
generated modules' text: every patch must still find its text in the current templates' output
(a template edit otherwise leaves the experiment unrunnable), and the patched module imports
(``kvgen.codegen.render.load_text``) as a module of its own beside the memoised one."""

from pathlib import Path

import pytest
from _scripts import benchmark_script

from kvgen.codegen import load
from kvgen.families import mla_decode as md
from kvgen.families.gqa_decode import ROWS_INT4_GROUPS, GQADecodeSpec

QUANT = benchmark_script("diag_quant_decode")
GQA_ROWS = benchmark_script("diag_gqa_rows")
MLA_SPECS = [
    cls(576, 512, "bf16", "wgmma", "sm90", "gpu")
    for cls in (md.MLADecodeDSMLASpec, md.MLADecodeFP8Spec, md.MLADecodeMXFP4Spec)
]


@pytest.mark.parametrize("experiment", list(QUANT.PATCHES))
@pytest.mark.parametrize("spec", MLA_SPECS, ids=lambda s: s.name)
def test_quant_decode_patches_apply(spec, experiment):
    module = QUANT.patched(spec, experiment)
    assert module is not load(spec)
    assert Path(module.__file__).read_text() != Path(load(spec).__file__).read_text()


GQA_ROWS_CASES = [("int4", g, e) for g in ROWS_INT4_GROUPS for e in GQA_ROWS.PATCHES["int4"]]
GQA_ROWS_CASES += [("int8", 0, e) for e in GQA_ROWS.PATCHES["int8"]]


@pytest.mark.parametrize(("kv", "group", "experiment"), GQA_ROWS_CASES)
def test_gqa_rows_patches_apply(kv, group, experiment):
    spec = GQADecodeSpec(128, 128, "bf16", kv, group, "rows", "sm90", "gpu")
    module = GQA_ROWS.patched(spec, [experiment])
    assert module is not load(spec)
    assert Path(module.__file__).read_text() != Path(load(spec).__file__).read_text()
