"""Tuned configs: ``tuned_configs/<arch>/<family>.json``, their schema, writer and loader.

The loader is what the generated ops use at run time: it reads each (arch, family) file once
per process, searching ``$KVGEN_TUNED_CONFIGS`` (a folder holding ``<arch>/<family>.json``)
before the files shipped in the package, and picks the entry of the nearest shape bucket. A
missing file or entry falls back to the template's defaults with one log line; a malformed
file, an unknown ``schema_version``, an arch that does not match, or an entry outside the
template's search space is a warning and a fallback, never a crash and never silently used.
Nothing here imports optuna.
"""

from __future__ import annotations

import json
import logging
import math
import os
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

from kvgen._resources import tuned_configs_dir
from kvgen.codegen.render import write_source
from kvgen.space import SpaceError, load_space, parse_bucket_key

SCHEMA_VERSION = 1
OVERRIDE_ENV = "KVGEN_TUNED_CONFIGS"
DISABLE_ENV = "KVGEN_DISABLE_TUNED"  # "1": always the template defaults (A/B comparisons)
use_tuned = os.environ.get(DISABLE_ENV, "0") != "1"
log = logging.getLogger("kvgen")

_ENV_KEYS = ("arch", "cuda", "device", "kvgen", "torch", "triton")
_PROVENANCE_KEYS = ("date", "sampler", "trials")


def validate(doc: Any, arch: str | None = None, family: str | None = None) -> list[str]:
    """Everything wrong with a tuned-config document (empty when it is valid)."""
    errors: list[str] = []
    if not isinstance(doc, dict):
        return ["the document is not a JSON object"]
    if doc.get("schema_version") != SCHEMA_VERSION:
        errors.append(f"schema_version is {doc.get('schema_version')!r}, not {SCHEMA_VERSION}")
        return errors
    for key in ("env", "provenance", "entries", "family"):
        if key not in doc:
            errors.append(f"missing {key!r}")
    if errors:
        return errors
    env, prov, entries = doc["env"], doc["provenance"], doc["entries"]
    if not isinstance(env, dict) or any(k not in env for k in _ENV_KEYS):
        errors.append(f"env must hold {', '.join(_ENV_KEYS)}")
    if not isinstance(prov, dict) or any(k not in prov for k in _PROVENANCE_KEYS):
        errors.append(f"provenance must hold {', '.join(_PROVENANCE_KEYS)}")
    if arch is not None and isinstance(env, dict) and env.get("arch") != arch:
        errors.append(f"env.arch is {env.get('arch')!r}, the file sits under {arch!r}")
    if family is not None and doc["family"] != family:
        errors.append(f"family is {doc['family']!r}, the file is named {family!r}")
    if not isinstance(entries, dict):
        return errors + ["entries must be an object"]
    for variant, buckets in entries.items():
        if not isinstance(buckets, dict) or not buckets:
            errors.append(f"{variant}: no buckets")
            continue
        for bkey, entry in buckets.items():
            where = f"{variant} [{bkey}]"
            try:
                parse_bucket_key(bkey)
            except ValueError:
                errors.append(f"{where}: bucket key is not name=int[,name=int...]")
            if not isinstance(entry, dict) or not isinstance(entry.get("meta"), dict):
                errors.append(f"{where}: needs a 'meta' object")
                continue
            if not all(isinstance(v, int) for v in entry["meta"].values()):
                errors.append(f"{where}: meta-parameters must be integers")
            for num in ("time_us", "default_time_us"):
                if not isinstance(entry.get(num), (int, float)) or entry[num] <= 0:
                    errors.append(f"{where}: {num} must be a positive number")
    return errors


def write(path: Path, doc: dict) -> None:
    """Write a config atomically, keys sorted (clean diffs), after checking it."""
    errors = validate(doc)
    if errors:
        raise ValueError(f"refusing to write an invalid config {path}: {errors}")
    write_source(path, json.dumps(doc, indent=2, sort_keys=True) + "\n")


def _candidates(arch: str, family: str) -> list[Path]:
    paths = []
    override = os.environ.get(OVERRIDE_ENV)
    if override:
        paths.append(Path(override) / arch / f"{family}.json")
    paths.append(tuned_configs_dir() / arch / f"{family}.json")
    return paths


@cache
def table(arch: str, family: str, override: str | None = None) -> dict[str, dict[str, dict]]:
    """variant -> bucket key -> entry, from the first readable, valid file; {} when none."""
    del override  # part of the cache key only: a changed override folder reloads
    for path in _candidates(arch, family):
        if not path.exists():
            continue
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            log.warning("kvgen: ignoring tuned config %s (unreadable: %s)", path, exc)
            continue
        errors = validate(doc, arch, family)
        if errors:
            log.warning("kvgen: ignoring tuned config %s: %s", path, "; ".join(errors[:3]))
            continue
        log.info("kvgen: tuned configs for %s/%s from %s", arch, family, path)
        return doc["entries"]
    return {}


def nearest_bucket(keys: list[str], size: dict[str, int]) -> str | None:
    """The bucket closest to ``size`` in log2 distance (summed over dimensions)."""

    def distance(key: str) -> tuple[float, str]:
        b = parse_bucket_key(key)
        if set(b) != set(size):
            return (math.inf, key)
        return (sum(abs(math.log2(max(size[k], 1)) - math.log2(max(b[k], 1))) for k in b), key)

    best = min(keys, key=distance, default=None)
    return best if best is not None and distance(best)[0] < math.inf else None


_warned: set[str] = set()


def _once(key: str, msg: str, *args: Any, level: int = logging.WARNING) -> None:
    if key not in _warned:
        _warned.add(key)
        log.log(level, msg, *args)


@lru_cache(maxsize=4096)
def _lookup(spec, size_items: tuple[tuple[str, int], ...]) -> dict[str, int]:
    size = dict(size_items)
    defaults = spec.default_meta(**size)
    if spec.target != "gpu":
        return defaults
    entries = table(spec.arch, spec.family, os.environ.get(OVERRIDE_ENV)).get(spec.name)
    if not entries:
        _once(spec.name, "kvgen: no tuned config for %s; using the template's defaults %s",
              spec.name, defaults)  # fmt: skip
        return defaults
    key = nearest_bucket(list(entries), size)
    if key is None:
        _once(spec.name + "?", "kvgen: tuned config for %s has no bucket over %s; defaults",
              spec.name, sorted(size))  # fmt: skip
        return defaults
    meta = entries[key]["meta"]
    try:
        space = load_space(spec.template)
    except SpaceError as exc:
        _once(spec.name + "!", "kvgen: %s; using defaults for %s", exc, spec.name)
        return defaults
    # A parameter added to the space after the tune takes the template's default (its value
    # was the kernel's behaviour when the entry was measured).
    meta = {k: meta.get(k, defaults.get(k)) for k in set(meta) | set(space.params)}
    if not space.allows(meta):
        _once(spec.name + "#", "kvgen: tuned entry %s [%s] = %s is outside the search space of "
              "%s; using the template's defaults", spec.name, key, meta, spec.template)  # fmt: skip
        return defaults
    return dict(meta)


def meta_params(spec, **size: int) -> dict[str, int]:
    """Meta-parameters for ``spec`` at this problem size: tuned if known, else defaults."""
    if not use_tuned:
        return spec.default_meta(**size)
    return dict(_lookup(spec, tuple(sorted(size.items()))))


def tuned_time(spec, **size: int) -> float | None:
    """The measured time (us) of ``spec``'s tuned entry nearest ``size``; None if not tuned.

    An entry exists only for what the tuner ran and checked against the reference on a GPU,
    which is what lets the ops choose between variants by it.
    """
    if not use_tuned or spec.target != "gpu":
        return None
    return _tuned_time(spec, tuple(sorted(size.items())))


@lru_cache(maxsize=4096)
def _tuned_time(spec, size_items: tuple[tuple[str, int], ...]) -> float | None:
    entries = table(spec.arch, spec.family, os.environ.get(OVERRIDE_ENV)).get(spec.name) or {}
    key = nearest_bucket(list(entries), dict(size_items))
    return None if key is None else float(entries[key]["time_us"])


def reset() -> None:
    """Forget loaded files and warnings (tests; a changed override folder)."""
    table.cache_clear()
    _lookup.cache_clear()
    _tuned_time.cache_clear()
    _warned.clear()
