"""Render a spec through its Jinja template into a real ``.py`` file, and import it.

Generated modules live in ``$KVGEN_CACHE_DIR`` (default ``~/.cache/kvgen``) under
``<kvgen version>/<family>-<template hash>/<variant name>.py``: a new kvgen or an edited template
gets a fresh folder, and a module is rewritten only when its text would change. Files are written
to a temporary file in the same folder and renamed, so concurrent processes never see half a
module. Triton reads kernel source through ``inspect``, which is why these are real files.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from functools import cache
from pathlib import Path
from types import ModuleType

import jinja2

import kvgen
from kvgen._resources import templates_dir
from kvgen.codegen.spec import VariantSpec

_lock = threading.Lock()
_loaded: dict[tuple[str, str], ModuleType] = {}


def template_path(template: str) -> Path:
    """A spec's ``template``: a name in kvgen's ``templates/``, or an absolute path (a family
    defined outside kvgen keeps its template, and the search space beside it, in its own
    folder)."""
    path = Path(template)
    return path if path.is_absolute() else templates_dir() / template


@cache
def _env(folder: str) -> jinja2.Environment:
    # a family's own folder first, then kvgen's (its shared includes: _header.j2, ...)
    roots = dict.fromkeys([folder, str(templates_dir())])
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(list(roots)),
        undefined=jinja2.StrictUndefined,  # a missing variable is an error, never ""
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


@cache
def template_hash(template: str) -> str:
    """Hash of a template and the shared includes (``_*.j2``) it may pull in."""
    path = template_path(template)
    includes = {p.name: p for p in sorted(templates_dir().glob("_*.j2"))}
    includes.update({p.name: p for p in sorted(path.parent.glob("_*.j2"))})
    h = hashlib.sha256()
    for p in [path, *includes.values()]:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def render(spec: VariantSpec) -> str:
    """The generated module's source text for ``spec``."""
    path = template_path(spec.template)
    template = _env(str(path.parent)).get_template(path.name)
    ctx = spec.context()
    ctx["kvgen_version"] = kvgen.__version__
    ctx["template_name"] = template_path(spec.template).name
    ctx["template_hash"] = template_hash(spec.template)
    ctx["spec_fields"] = spec.fields()
    return template.render(**ctx)


def cache_root() -> Path:
    env = os.environ.get("KVGEN_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvgen"


def write_source(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` atomically; skip the write when the file already holds it."""
    try:
        if path.read_text() == text:
            return False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return True


def module_path(spec: VariantSpec) -> Path:
    folder = f"{spec.family}-{template_hash(spec.template)}"
    return cache_root() / kvgen.__version__ / folder / f"{spec.name}.py"


def load(spec: VariantSpec) -> ModuleType:
    """Render (if needed), write (if changed) and import the module of ``spec``; memoised."""
    key = (spec.name, template_hash(spec.template))
    module = _loaded.get(key)
    if module is not None:
        return module
    with _lock:
        module = _loaded.get(key)
        if module is not None:
            return module
        path = module_path(spec)
        write_source(path, render(spec))
        module = _import(path, f"{spec.module_name}_{key[1]}")
        _loaded[key] = module
        return module


def load_text(spec: VariantSpec, text: str, tag: str) -> ModuleType:
    """A module of ``spec`` from ``text`` instead of its rendering (a diagnostic's edit of it,
    e.g. a stage of the kernel left out), written beside the rendered module under ``tag`` (an
    identifier) and imported under a name of its own; not memoised."""
    path = module_path(spec).with_name(f"{spec.name}-{tag}.py")
    write_source(path, text)
    return _import(path, f"{spec.module_name}_{template_hash(spec.template)}_{tag}")


def _import(path: Path, mod_name: str) -> ModuleType:
    imp_spec = importlib.util.spec_from_file_location(mod_name, path)
    assert imp_spec is not None and imp_spec.loader is not None
    module = importlib.util.module_from_spec(imp_spec)
    sys.modules[mod_name] = module
    try:
        imp_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[mod_name]
        raise
    return module
