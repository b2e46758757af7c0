"""Render k8s/base/serve-config.yaml (the RayService's serveConfigV2) from serve_app/config.yaml.

serve_app/config.yaml is the one source of the Serve application; the
RayService's ``serveConfigV2`` is that file with the few values a GPU cluster
needs changed, listed in k8s/render/serve-overrides.yaml (a render input, never
applied)::

    applications:
      prefix-cache:            # the application of that name
        args: {gpus_per_replica: 1, worker: {disk_dir: /mnt/nvme}}

Mappings merge key by key; any other value replaces the config's (a list too,
whole). Naming an application the config lacks, or putting a scalar where the
config has a mapping (or the reverse), is an error.

The output is the merged config dumped as YAML (keys in the config's order, new
keys last) under a comment listing every value that differs from config.yaml.
Kustomize does the rest: k8s/base/kustomization.yaml turns the file into a
build-time ConfigMap and copies its text into the RayService's
``spec.serveConfigV2`` (``kubectl kustomize k8s/`` shows the result). Same
inputs, same bytes. ``--check`` renders in memory and exits 1 with a unified
diff when the file on disk differs (CI and tests run it).
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = "serve_app/config.yaml"
DEFAULT_OVERRIDES = "k8s/render/serve-overrides.yaml"
DEFAULT_OUT = "k8s/base/serve-config.yaml"
_UNSET = object()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--check", action="store_true",
                   help="render in memory; exit 1 with a diff when --out differs")
    p.add_argument("--config", default=None, help=f"Serve config (default {DEFAULT_CONFIG})")
    p.add_argument("--overrides", default=None,
                   help=f"the GPU cluster's changes to the Serve config (default {DEFAULT_OVERRIDES})")
    p.add_argument("--out", default=None, help=f"rendered serveConfigV2, '-' for stdout (default {DEFAULT_OUT})")


def _path(given: str | None, default: str) -> Path:
    # Defaults are the checkout's files wherever the command runs from; given paths are the user's.
    return Path(given) if given else ROOT / default


def _shown(path: Path) -> str:
    """The path as the output names it: repo-relative, so the bytes do not depend on the checkout."""
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return path.as_posix()


def _merge(base: dict, override: dict, where: str, changes: list[str]) -> None:
    for key, value in override.items():
        here = f"{where}.{key}" if where else str(key)
        old = base.get(key, _UNSET)
        if isinstance(value, dict):
            if old is _UNSET or old is None:
                old = base[key] = {}
            if not isinstance(old, dict):
                raise ValueError(f"render override {here} is a mapping but the Serve config has {old!r}")
            _merge(old, value, here, changes)
            continue
        if isinstance(old, dict):
            raise ValueError(f"render override {here}={value!r} would replace a mapping of the Serve config")
        if old != value:
            shown_old = "(unset)" if old is _UNSET else json.dumps(old)
            changes.append(f"{here}: {shown_old} -> {json.dumps(value)}")
        base[key] = value


def apply_overrides(config: dict, overrides: dict) -> tuple[dict, list[str]]:
    """``config`` with ``overrides`` merged (see the module doc), and the changes as lines."""
    merged = copy.deepcopy(config)
    overrides = dict(overrides or {})
    changes: list[str] = []
    apps = overrides.pop("applications", None) or {}
    if not isinstance(apps, dict):
        raise ValueError("render override 'applications' must map application names to overrides")
    by_name = {app.get("name"): app for app in merged.get("applications") or []}
    for name, app_override in apps.items():
        if name not in by_name:
            raise ValueError(f"render override names application {name!r}; the Serve config has {sorted(by_name)}")
        _merge(by_name[name], app_override or {}, f"applications[{name}]", changes)
    _merge(merged, overrides, "", changes)
    return merged, changes


def load_overrides(text: str, name: str = DEFAULT_OVERRIDES) -> dict:
    """The overrides mapping of an overrides file (empty file: no changes)."""
    overrides = yaml.safe_load(text)
    if overrides is None:
        return {}
    if not isinstance(overrides, dict):
        raise ValueError(f"{name} must be a mapping of Serve config overrides, not {type(overrides).__name__}")
    if "render" in overrides:
        raise ValueError(f"{name} has a 'render:' key: that is the old rayservice.template.yaml format; "
                         f"the overrides file holds what was under render.serveConfigOverrides")
    return overrides


def render(config_text: str, overrides_text: str, config_name: str = DEFAULT_CONFIG,
           overrides_name: str = DEFAULT_OVERRIDES) -> str:
    config = yaml.safe_load(config_text)
    if not isinstance(config, dict) or not isinstance(config.get("applications"), list):
        raise ValueError(f"{config_name} is not a Serve config (no 'applications' list)")
    merged, changes = apply_overrides(config, load_overrides(overrides_text, overrides_name))
    dumped = yaml.safe_dump(merged, sort_keys=False, default_flow_style=False, width=1000)
    lines = [f"# GENERATED by `prefix-cache k8s render` from {config_name} and {overrides_name}.",
             "# Do not edit: change those and rerun it; `prefix-cache k8s render --check` fails on drift.",
             "# Kustomize copies this text into the RayService's serveConfigV2 (k8s/base/kustomization.yaml).",
             f"# Changes from {config_name} for the GPU cluster:"]
    lines += [f"#   {change}" for change in changes] or ["#   (none)"]
    return "\n".join(lines) + "\n" + dumped


def run(args: argparse.Namespace) -> int:
    config_path = _path(args.config, DEFAULT_CONFIG)
    overrides_path = _path(args.overrides, DEFAULT_OVERRIDES)
    text = render(config_path.read_text(), overrides_path.read_text(),
                  _shown(config_path), _shown(overrides_path))
    if args.out == "-":
        if args.check:
            raise ValueError("--check needs a file to compare with, not --out -")
        sys.stdout.write(text)
        return 0
    out = _path(args.out, DEFAULT_OUT)
    current = out.read_text() if out.exists() else ""
    if args.check:
        if current == text:
            print(f"{_shown(out)} is up to date")
            return 0
        sys.stdout.writelines(difflib.unified_diff(
            current.splitlines(keepends=True), text.splitlines(keepends=True),
            fromfile=f"{_shown(out)} (on disk)", tofile=f"{_shown(out)} (rendered)"))
        print(f"\n{_shown(out)} is out of date: run `prefix-cache k8s render`")
        return 1
    if current == text:
        print(f"{_shown(out)} unchanged")
    else:
        out.write_text(text)
        print(f"wrote {_shown(out)}")
    return 0
