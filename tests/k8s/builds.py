"""The manifests as ``kubectl kustomize`` builds them, built once per target
and handed out as fresh copies (tests mutate them)."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest

from tests.k8s import validation as v


@functools.cache
def _built(path: Path) -> tuple[dict, ...]:
    return tuple(v.kustomize_build(path))


def built(target: str = "k8s") -> list[dict]:
    """The documents `kubectl kustomize` builds for a target (a fresh copy each call)."""
    if v.kubectl() is None:
        pytest.skip(f"kubectl not found: tests/k8s build the manifests with `kubectl kustomize` "
                    f"(kubectl >= 1.27; set {v.KUBECTL_ENV} to its path)")
    return copy.deepcopy(list(_built(v.KUSTOMIZE_TARGETS[target])))


def by_kind(target: str = "k8s") -> dict[str, dict]:
    docs = built(target)
    kinds = {doc["kind"]: doc for doc in docs}
    assert len(kinds) == len(docs), [d["kind"] for d in docs]
    return kinds


def rayservice(target: str = "k8s") -> dict:
    return by_kind(target)["RayService"]
