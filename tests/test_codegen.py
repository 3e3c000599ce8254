"""The generator: specs validate themselves, names come from fields, modules are real files."""

import dataclasses
import os
import subprocess
import sys
import textwrap

import jinja2
import pytest

import kvgen
from kvgen import registry
from kvgen.codegen import SpecError, load, render, template_hash
from kvgen.codegen.render import module_path
from kvgen.families.mxfp4_mla import GatherMXFP4MLASpec, StoreMXFP4MLASpec


@pytest.mark.parametrize(
    "kwargs",
    [
        {"group": 24},
        {"group": True},
        {"latent": 100},
        {"latent": 512.0},
        {"latent": 480, "group": 64},  # group does not divide latent
        {"dtype": "fp64"},
        {"layout": "hnd"},
        {"arch": "sm75"},
        {"target": "cpu"},
    ],
)
def test_spec_rejects_unknown_values(kwargs):
    with pytest.raises(SpecError) as info:
        StoreMXFP4MLASpec(**kwargs)
    assert isinstance(info.value, ValueError)
    assert next(iter(kwargs)) in str(info.value)


def test_spec_is_frozen_and_named_from_every_field():
    spec = StoreMXFP4MLASpec(group=64, latent=448, dtype="fp32", layout="flat")
    assert spec.name == "store_mxfp4_mla-g64-l448-fp32-flat-sm90-gpu"
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.group = 32  # type: ignore[misc]
    for value in spec.fields().values():
        assert str(value) in spec.name


def test_registry_names_are_unique_and_rebuild_their_spec():
    specs = registry.variants("sm90", "gpu")
    names = [s.name for s in specs]
    assert len(names) == len(set(names))
    assert {s.family for s in specs} == {
        "store_mxfp4_mla",
        "store_mxfp4_rope_mla",
        "gather_mxfp4_mla",
        "gather_mxfp4_rope_mla",
        "store_kv_per_token_head",
        "store_kv_int4_per_token_head",
        "mla_decode",
        "concat_and_cache_mla",
        "gather_mla_cache",
        "mla_decode_fp8_ds_mla",
        "mla_decode_fp8",
        "mla_decode_mxfp4",
        "gqa_decode",
    }
    for spec in specs:
        assert type(spec)(**spec.fields()) == spec


def test_registry_lookup_by_family_and_typo():
    specs = registry.lookup(["gather_mxfp4_mla"], "sm90", "interp")
    assert specs and all(s.family == "gather_mxfp4_mla" for s in specs)
    with pytest.raises(KeyError, match="did you mean"):
        registry.lookup(["store_mxfp4_mla-g32-l512-bf16-paged-sm90-gpux"], "sm90", "gpu")


def test_registry_lookup_by_pattern():
    listed = registry.variants("sm90", "gpu")
    rows = registry.lookup(["gqa_decode-*-rows-*"], "sm90", "gpu")
    assert rows == [s for s in listed if s.family == "gqa_decode" and s.variant == "rows"]
    assert len(rows) >= 8
    # A spec that two names give comes once, where the first name gives it.
    both = registry.lookup(["gqa_decode-*-kvint8-*-rows-*", "gqa_decode-*-rows-*"], "sm90", "gpu")
    assert both[:2] == [s for s in rows if s.kv == "int8"] and sorted(
        s.name for s in both
    ) == sorted(s.name for s in rows)
    assert registry.lookup(["store_mxfp4_mla", "store_mxfp4_mla-g?2-*"], "sm90", "gpu") == [
        s for s in listed if s.family == "store_mxfp4_mla"
    ]
    # A pattern that matches nothing names the families to pick from, before any work.
    with pytest.raises(KeyError, match="no variant for sm90/gpu matches 'gqa_decode-\\*-rowz'.*"
                       "families: concat_and_cache_mla"):  # fmt: skip
        registry.lookup(["gqa_decode-*-rowz"], "sm90", "gpu")


def test_every_listed_name_parses_back_to_its_spec():
    for arch, target in (("sm90", "gpu"), ("sm80", "interp")):
        for spec in registry.variants(arch, target):
            assert type(spec).from_name(spec.name) == spec


def test_registry_lookup_of_unlisted_sizes():
    # The bench's 1 x 576 int4 store (V as wide as K) is not in the default list; by name it is
    # found, as every size a family allows generates on demand.
    name = "store_kv_int4_per_token_head-c32-d576-dv576-bf16-sm90-gpu"
    assert name not in {s.name for s in registry.variants("sm90", "gpu")}
    (spec,) = registry.lookup([name], "sm90", "gpu")
    assert (spec.head_size, spec.head_size_v, spec.name) == (576, 576, name)
    (spec,) = registry.lookup(["mla_decode-d288-dv256-fp16-portable-sm80-interp"], "sm80", "interp")
    assert spec.head_dim == 288
    # A value the axis forbids, or a non-canonical spelling: the reason, not a guess.
    with pytest.raises(KeyError, match="head_size_v=5760 is not allowed"):
        registry.lookup([name.replace("dv576", "dv5760")], "sm90", "gpu")
    with pytest.raises(KeyError, match="did you mean store_kv_int4_per_token_head-c32-d576-"):
        registry.lookup([name.replace("-d576", "-d0576")], "sm90", "gpu")
    # A full name says its arch and target: they win over the ones asked for (which pick the
    # variants of family names).
    (spec,) = registry.lookup([name], "sm80", "interp")
    assert (spec.arch, spec.target) == ("sm90", "gpu")
    # A kind that does not exist for the arch / target the name spells: not found, and why.
    with pytest.raises(KeyError, match="wgmma variant needs"):
        registry.lookup(["mla_decode-d576-dv512-bf16-wgmma-sm90-interp"], "sm90", "interp")


def test_render_header_carries_the_spec():
    spec = StoreMXFP4MLASpec(group=16, latent=256)
    text = render(spec)
    assert f"Variant: {spec.name}" in text
    assert f"hash {template_hash(spec.template)}" in text
    assert "    group = 16" in text and "    latent = 256" in text
    assert f"kvgen {kvgen.__version__}" in text
    compile(text, spec.name, "exec")


def test_undefined_template_variable_is_an_error(monkeypatch):
    spec = GatherMXFP4MLASpec()
    monkeypatch.setattr(GatherMXFP4MLASpec, "derived", lambda self: {})
    with pytest.raises(jinja2.UndefinedError):
        render(spec)


def test_module_cache_is_keyed_written_once_and_reused(local_target):
    arch, target = local_target
    spec = StoreMXFP4MLASpec(group=32, latent=256, arch=arch, target=target)
    module = load(spec)
    path = module_path(spec)
    assert module.__file__ == str(path)
    assert path.parent.name == f"store_mxfp4_mla-{template_hash(spec.template)}"
    assert path.parent.parent.name == kvgen.__version__
    assert load(spec) is module
    mtime = path.stat().st_mtime_ns
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]

    # Another process finds the same file and does not rewrite it.
    code = textwrap.dedent(
        f"""
        from kvgen.codegen import load
        from kvgen.families.mxfp4_mla import StoreMXFP4MLASpec
        m = load(StoreMXFP4MLASpec(group=32, latent=256, arch={arch!r}, target={target!r}))
        print(m.__file__)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        check=True,
    )
    assert out.stdout.strip() == str(path)
    assert path.stat().st_mtime_ns == mtime


def test_changed_text_is_rewritten_atomically(tmp_path):
    from kvgen.codegen import write_source

    target = tmp_path / "m.py"
    assert write_source(target, "a = 1\n")
    assert not write_source(target, "a = 1\n")
    assert write_source(target, "a = 2\n")
    assert target.read_text() == "a = 2\n"
    assert [p.name for p in tmp_path.iterdir()] == ["m.py"]


def test_generated_code_passes_the_linter(tmp_path):
    from kvgen.codegen import write_source
    from kvgen.families.gqa_decode import ROWS_INT4_GROUPS, GQADecodeSpec
    from kvgen.families.mla_decode import MLADecodeMXFP4Spec

    # (and every form a template generates, whether or not kvgen lists it: the GQA rows variant
    # over int4 and fp8 e5m2, the MLA rows variant over MXFP4)
    unlisted = [GQADecodeSpec(128, 128, "bf16", "int4", g, "rows", "sm90", "gpu")
                for g in ROWS_INT4_GROUPS]  # fmt: skip
    unlisted += [GQADecodeSpec(128, 128, dt, "fp8e5m2", 0, "rows", "sm90", "gpu")
                 for dt in ("bf16", "fp16")]  # fmt: skip
    unlisted += [MLADecodeMXFP4Spec(d, 512, "bf16", "rows", "sm90", "gpu") for d in (576, 512)]
    for spec in registry.variants("sm90", "gpu") + registry.variants("sm90", "interp") + unlisted:
        write_source(tmp_path / f"{spec.name}.py", render(spec))
    ruff = [sys.executable, "-m", "ruff"]
    args = ["--config", str(_pyproject()), str(tmp_path)] if _pyproject() else [str(tmp_path)]
    check = subprocess.run([*ruff, "check", *args], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    fmt = subprocess.run([*ruff, "format", "--check", *args], capture_output=True, text=True)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def _pyproject():
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "pyproject.toml"
    return path if path.exists() else None


def test_importing_ops_does_not_import_optuna():
    code = "import sys, kvgen.ops; assert 'optuna' not in sys.modules, 'optuna imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_templates_come_from_the_package():
    import importlib.resources
    from pathlib import Path

    from kvgen._resources import templates_dir, tuned_configs_dir

    assert templates_dir() == Path(str(importlib.resources.files("kvgen.templates")))
    assert (templates_dir() / "store_mxfp4_mla.py.j2").is_file()
    assert tuned_configs_dir() == Path(str(importlib.resources.files("kvgen.tuned_configs")))


def _non_constexpr_globals_used_in_kernels(source: str) -> set[str]:
    """Module-level names that a @triton.jit function reads but that are not tl.constexpr(...).

    Triton on the GPU refuses such globals while the CPU interpreter accepts them, so this
    check stands in for the GPU compiler on machines without one.
    """
    import ast

    tree = ast.parse(source)
    plain_globals = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            value = node.value
            is_constexpr = (
                isinstance(value, ast.Call)
                and isinstance(value.func, ast.Attribute)
                and value.func.attr == "constexpr"
            )
            if not is_constexpr:
                plain_globals.update(t.id for t in node.targets if isinstance(t, ast.Name))
    used = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(
            ast.unparse(d).startswith("triton.jit") for d in node.decorator_list
        ):
            used |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    return used & plain_globals


def test_kernels_read_only_constexpr_globals():
    for spec in registry.variants("sm90", "gpu") + registry.variants("sm90", "interp"):
        bad = _non_constexpr_globals_used_in_kernels(render(spec))
        assert not bad, f"{spec.name}: kernel reads non-constexpr globals {bad}"


def test_project_sources_pass_the_linter():
    root = _pyproject()
    if root is None:  # an installed copy without the checkout around it
        pytest.skip("needs the source checkout")
    paths = [str(root.parent / p) for p in ("kvgen", "tests", "benchmarks", "scripts")]
    for command in (["check"], ["format", "--check", "--diff"]):
        result = subprocess.run(
            [sys.executable, "-m", "ruff", *command, *paths], capture_output=True, text=True
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_every_subpackage_is_packaged():
    """A kvgen sub-package missing from pyproject's list is missing from the wheel."""
    import tomllib

    root = _pyproject()
    if root is None:
        pytest.skip("needs the source checkout")
    listed = set(tomllib.loads(root.read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(p.parent.relative_to(root.parent).parts)
        for p in (root.parent / "kvgen").rglob("__init__.py")
    }
    assert on_disk <= listed, f"not packaged: {sorted(on_disk - listed)}"
