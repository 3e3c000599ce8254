"""Tuned configs: ``tuned_configs/<arch>/<family>.json``, their schema, writer and loader.

The loader is what the generated ops use at run time: it reads each (arch, family) file once
per process, searching ``$KVGEN_TUNED_CONFIGS`` (a folder holding ``<arch>/<family>.json``)
before the files shipped in the package, and picks the entry of the nearest shape bucket. In
each of those folders a GPU model's own configs, ``<arch>/<device>/<family>.json`` (``device``:
its name as CUDA reports it, lower case, other characters than letters and digits as ``-``,
e.g. ``nvidia-h100-80gb-hbm3``), come before the arch's: GPUs of one arch differ in memory
bandwidth and clocks, and a config tuned on one may be slower on another. A
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
import re
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

from kvgen._resources import tuned_configs_dir
from kvgen.codegen.render import write_source
from kvgen.space import SpaceError, bucket_key, load_space, parse_bucket_key

SCHEMA_VERSION = 1
OVERRIDE_ENV = "KVGEN_TUNED_CONFIGS"
DISABLE_ENV = "KVGEN_DISABLE_TUNED"  # "1": always the template defaults (A/B comparisons)
DEVICE_ENV = "KVGEN_TUNED_DEVICE"  # the device folder to look in first ("": none)
use_tuned = os.environ.get(DISABLE_ENV, "0") != "1"
log = logging.getLogger("kvgen")

_ENV_KEYS = ("arch", "cuda", "device", "kvgen", "torch", "triton")
_PROVENANCE_KEYS = ("date", "sampler", "trials")


def device_folder(name: str) -> str:
    """The folder of a GPU model's own configs, from its name as CUDA reports it:
    ``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def this_device() -> str:
    """The device folder the loader looks in first: ``$KVGEN_TUNED_DEVICE`` when set (empty:
    none), else the folder of the GPU model CUDA's current device is when first asked; empty
    without a GPU."""
    chosen = os.environ.get(DEVICE_ENV)
    return _gpu_folder() if chosen is None else chosen


@cache
def _gpu_folder() -> str:
    import torch

    try:
        return device_folder(torch.cuda.get_device_name()) if torch.cuda.is_available() else ""
    except (AssertionError, RuntimeError):  # (a CUDA that cannot name its device: none)
        return ""


def _device_of(path: Path, arch: str | None) -> str | None:
    """The device folder a file sits in (``<arch>/<device>/<family>.json``), or None."""
    return path.parent.name if arch is not None and path.parent.parent.name == arch else None


def validate(
    doc: Any, arch: str | None = None, family: str | None = None, device: str | None = None
) -> list[str]:
    """Everything wrong with a tuned-config document (empty when it is valid): ``arch``,
    ``family`` and ``device`` (a device folder) are where the file sits."""
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
    if device is not None and isinstance(env, dict):
        measured = device_folder(str(env.get("device", "")))
        if measured != device:
            errors.append(f"env.device is {env.get('device')!r}, the file sits under {device!r}")
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


def write(path: Path, doc: dict, device: str | None = None) -> None:
    """Write a config atomically, keys sorted (clean diffs), after checking it (with
    ``device``: that it was measured on that device folder's GPU model)."""
    errors = validate(doc, device=device)
    if errors:
        raise ValueError(f"refusing to write an invalid config {path}: {errors}")
    write_source(path, json.dumps(doc, indent=2, sort_keys=True) + "\n")


def folders(arch: str, device: str = "") -> list[Path]:
    """Where the tuned configs of ``arch`` are looked for, first match first: the folder
    ``$KVGEN_TUNED_CONFIGS/<arch>`` (when set), then the package's, each after its ``device``
    subfolder (when a device folder is given)."""
    roots = []
    override = os.environ.get(OVERRIDE_ENV)
    if override:
        roots.append(Path(override) / arch)
    roots.append(tuned_configs_dir() / arch)
    return [f for root in roots for f in ([root / device] if device else []) + [root]]


def _candidates(arch: str, family: str, device: str) -> list[Path]:
    return [folder / f"{family}.json" for folder in folders(arch, device)]


def files(arch: str) -> list[Path]:
    """Every tuned-config file of ``arch`` (for ``kvgen show``): per folder in search order,
    the arch's files, then those of each device folder."""
    out = []
    for root in folders(arch):
        if root.is_dir():
            out += sorted(root.glob("*.json")) + sorted(root.glob("*/*.json"))
    return out


def read(path: Path, arch: str | None = None) -> tuple[dict | None, list[str]]:
    """A file's document and what is wrong with it (``validate``, with the device folder it
    sits in under ``arch``; unreadable: no document)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return None, [f"unreadable: {exc}"]
    return doc, validate(doc, arch, path.stem, _device_of(path, arch))


def summary(arch: str, spec_class_of) -> tuple[list[dict], list[str]]:
    """``kvgen show``'s documents: per valid tuned-config file of ``arch`` its path, family,
    environment, provenance and ``rows`` (``spec_class_of(family)`` gives the spec class
    ``rows`` needs) and ``device``: its device folder, or None for the arch's files (used on any
    GPU of the arch that has no file of its own); and what is wrong with each invalid file."""
    docs, invalid = [], []
    for path in files(arch):
        doc, errors = read(path, arch)
        if errors:
            invalid.append(f"{path}: invalid ({'; '.join(errors[:3])})")
            continue
        docs.append(
            {
                "file": str(path),
                "device": _device_of(path, arch),
                "family": doc["family"],
                "env": doc["env"],
                "provenance": doc["provenance"],
                "rows": rows(doc, spec_class_of(doc["family"])),
            }
        )
    return docs, invalid


def rows(doc: dict, cls: type | None = None) -> list[dict[str, Any]]:
    """A valid document's entries as rows (variant, bucket, meta, times, speed-up, ``adopted``:
    the record of a config taken from another run, or None), with ``used``: whether the op
    takes this variant at this bucket. Where the family's op chooses between variants by their
    tuned times (its spec class ``cls``'s ``chosen_by_tuning`` names the field that differs),
    that is the fastest of them at the bucket; otherwise every entry is used. Sizes in the
    class's ``compared_at`` ({size: value}) are where the variants are compared: an entry at
    another value of one (e.g. the GQA rows variant's row_align 4, vLLM's inline rows) is used
    where its variant is used at that value, the rest of its bucket the same."""
    axis = getattr(cls, "chosen_by_tuning", None) if cls is not None else None
    fixed = getattr(cls, "compared_at", {}) if axis is not None else {}

    def compared(key: str) -> tuple[str, bool]:
        """(the bucket without the compared_at sizes, whether it is at their values)."""
        b = parse_bucket_key(key)
        rest = bucket_key({k: v for k, v in b.items() if k not in fixed})
        return rest, all(b.get(k, v) == v for k, v in fixed.items())

    out = []
    keys = []  # a row's (group, bucket without the compared_at sizes, whether at their values)
    for variant, buckets in sorted(doc["entries"].items()):
        group = variant
        if axis is not None:
            try:
                fields = cls.from_name(variant).fields()
                group = tuple(sorted((k, v) for k, v in fields.items() if k != axis))
            except ValueError:  # a name this kvgen cannot parse: its own group
                pass
        for key, e in buckets.items():
            out.append(
                {
                    "variant": variant,
                    "bucket": key,
                    "meta": e["meta"],
                    "time_us": e["time_us"],
                    "default_time_us": e["default_time_us"],
                    "speedup": e["default_time_us"] / e["time_us"],
                    # taken from another run by benchmarks/adopt_faster.py: its record
                    "adopted": e.get("adopted"),
                }
            )
            keys.append((group, *compared(key)))
    best: dict[tuple, float] = {}
    for r, (group, rest, at) in zip(out, keys, strict=True):
        if at:
            best[group, rest] = min(best.get((group, rest), math.inf), r["time_us"])
    used_at: dict[tuple, bool] = {}  # (variant, the rest of the bucket) -> used where compared
    for r, (group, rest, at) in zip(out, keys, strict=True):
        if at:
            r["used"] = used_at[r["variant"], rest] = r["time_us"] == best[group, rest]
    for r, (_, rest, at) in zip(out, keys, strict=True):
        if not at:
            r["used"] = used_at.get((r["variant"], rest), False)
    return out


@cache
def _load(arch: str, family: str, override: str | None, device: str) -> tuple[Path | None, dict]:
    """(file, variant -> bucket key -> entry) from the first readable, valid file;
    (None, {}) when none."""
    del override  # part of the cache key only: a changed override folder reloads
    for path in _candidates(arch, family, device):
        if not path.exists():
            continue
        doc, errors = read(path, arch)
        if errors:
            log.warning("kvgen: ignoring tuned config %s: %s", path, "; ".join(errors[:3]))
            continue
        hard, soft = env_mismatch(doc["env"])
        if hard:
            log.warning(
                "kvgen: ignoring tuned config %s: it was measured with %s (its configs "
                "were timed on other generated code)",
                path,
                "; ".join(hard),
            )
            continue
        if soft:
            # a matter of speed only: worth a warning where kernels run on a GPU
            import torch

            level = logging.WARNING if torch.cuda.is_available() else logging.INFO
            log.log(
                level,
                "kvgen: tuned config %s was measured with %s; using it",
                path,
                "; ".join(soft),
            )
        log.info("kvgen: tuned configs for %s/%s from %s", arch, family, path)
        return path, doc["entries"]
    return None, {}


def _major_minor(version: object) -> tuple[str, ...]:
    return tuple(str(version).split("+")[0].split(".")[:2])


def env_mismatch(env: dict) -> tuple[list[str], list[str]]:
    """How a tuned file's ``env`` differs from this process: (hard, soft) differences. Another
    Triton major.minor is hard (Triton generated other code from the same source, so the
    measured ranking need not hold); another torch major.minor or CUDA version is soft."""
    import torch
    import triton

    hard, soft = [], []
    if _major_minor(env.get("triton")) != _major_minor(triton.__version__):
        hard.append(f"Triton {env.get('triton')} (this is {triton.__version__})")
    if _major_minor(env.get("torch")) != _major_minor(torch.__version__):
        soft.append(f"torch {env.get('torch')} (this is {torch.__version__})")
    if torch.version.cuda is not None and str(env.get("cuda")) != torch.version.cuda:
        soft.append(f"CUDA {env.get('cuda')} (this is {torch.version.cuda})")
    return hard, soft


def table(
    arch: str, family: str, override: str | None = None, device: str | None = None
) -> dict[str, dict[str, dict]]:
    """variant -> bucket key -> entry, from the first readable, valid file (``device``: the
    device folder to look in first; None: ``this_device()``); {} when none."""
    return _load(arch, family, override, this_device() if device is None else device)[1]


def tuned_name(spec) -> str:
    """The name ``spec``'s entries have in the tuned JSON: its own, or for the interpreter
    target its GPU twin's (the interpreter runs the same kernels, with the same
    meta-parameters; only GPUs are tuned)."""
    if spec.target == "gpu":
        return spec.name
    return spec.name.removesuffix("-" + spec.target) + "-gpu"


def bucket_distance(a: dict[str, int], b: dict[str, int]) -> float:
    """How far apart two sizes (or buckets) are: the sum over dimensions of |log2| of their
    ratio; infinite where they name different dimensions."""
    if set(a) != set(b):
        return math.inf
    return sum(abs(math.log2(max(a[k], 1)) - math.log2(max(b[k], 1))) for k in a)


def nearest_bucket(keys: list[str], size: dict[str, int]) -> str | None:
    """The bucket closest to ``size`` in ``bucket_distance``."""

    def distance(key: str) -> tuple[float, str]:
        return (bucket_distance(size, parse_bucket_key(key)), key)

    best = min(keys, key=distance, default=None)
    return best if best is not None and distance(best)[0] < math.inf else None


_warned: set[str] = set()


def _once(key: str, msg: str, *args: Any, level: int = logging.WARNING) -> None:
    if key not in _warned:
        _warned.add(key)
        log.log(level, msg, *args)


def _debug_once(spec, size: dict[str, int], how: str, meta: dict[str, int]) -> None:
    # One line per specialisation and bucket (or fallback) at DEBUG: which config a call used.
    if not log.isEnabledFor(logging.DEBUG):  # (KVGEN_DISABLE_TUNED=1 calls this every call)
        return
    _once(
        f"{spec.name} {how}",
        "kvgen: %s at %s: %s -> %s",
        spec.name,
        ",".join(f"{k}={v}" for k, v in sorted(size.items())),
        how,
        meta,
        level=logging.DEBUG,
    )


@lru_cache(maxsize=4096)
def _lookup(spec, size_items: tuple[tuple[str, int], ...]) -> dict[str, int]:
    size = dict(size_items)
    defaults = spec.default_meta(**size)
    path, table_ = _load(spec.arch, spec.family, os.environ.get(OVERRIDE_ENV), this_device())
    name = tuned_name(spec)
    entries = table_.get(name)
    if not entries:
        # loud on a GPU; the interpreter runs many variants nobody tunes
        level = logging.WARNING if spec.target == "gpu" else logging.INFO
        _once(
            spec.name,
            "kvgen: no tuned config for %s; using the template's defaults %s",
            name,
            defaults,
            level=level,
        )
        _debug_once(spec, size, "no tuned entry, template defaults", defaults)
        return defaults
    key = nearest_bucket(list(entries), size)
    if key is None:
        _once(
            spec.name + "?",
            "kvgen: tuned config for %s has no bucket over %s; defaults",
            name,
            sorted(size),
        )
        _debug_once(spec, size, "no bucket over these sizes, template defaults", defaults)
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
        _once(
            spec.name + "#",
            "kvgen: tuned entry %s [%s] = %s is outside the search space of "
            "%s; using the template's defaults",
            name,
            key,
            meta,
            spec.template,
        )
        _debug_once(spec, size, "tuned entry outside the space, template defaults", defaults)
        return defaults
    # An entry that breaks one of the space's constraints (a hand-edited file, or one tuned
    # before the constraint) is a config the kernel may get wrong or cannot launch.
    if broken := space.violations(spec, meta):
        _once(spec.name + "!" + key, "kvgen: tuned entry %s [%s] = %s breaks %s of %s; using "
              "the template's defaults", name, key, meta, broken, spec.template)  # fmt: skip
        _debug_once(spec, size, f"[{key}] breaks {broken}, template defaults", defaults)
        return defaults
    # Another bucket's entry may break a call constraint at this size (e.g. more pages in
    # flight than the kernel for these rows takes): such an entry is not used here.
    here = {k: v for k, v in size.items() if k in space.buckets}
    if broken := space.call_violations(spec, meta, here):
        _debug_once(spec, size, f"[{key}] breaks {broken} here, template defaults", defaults)
        return defaults
    _debug_once(spec, size, f"tuned {path} [{key}]", meta)
    return dict(meta)


def meta_params(spec, **size: int) -> dict[str, int]:
    """Meta-parameters for ``spec`` at this problem size: tuned if known, else defaults."""
    if not use_tuned:
        meta = spec.default_meta(**size)
        _debug_once(spec, size, f"{DISABLE_ENV}=1, template defaults", meta)
        return meta
    return dict(_lookup(spec, tuple(sorted(size.items()))))


def tuned_time(spec, **size: int) -> float | None:
    """The measured time (us) of ``spec``'s tuned entry nearest ``size``; None if not tuned.

    An entry exists only for what the tuner ran and checked against the reference on a GPU,
    which is what lets the ops choose between variants by it.
    """
    if not use_tuned:
        return None
    return _tuned_time(spec, tuple(sorted(size.items())))


@lru_cache(maxsize=4096)
def _tuned_time(spec, size_items: tuple[tuple[str, int], ...]) -> float | None:
    table_ = table(spec.arch, spec.family, os.environ.get(OVERRIDE_ENV))
    entries = table_.get(tuned_name(spec)) or {}
    key = nearest_bucket(list(entries), dict(size_items))
    return None if key is None else float(entries[key]["time_us"])


def reset() -> None:
    """Forget loaded files and warnings (tests; a changed override folder)."""
    _load.cache_clear()
    _lookup.cache_clear()
    _tuned_time.cache_clear()
    _warned.clear()
