"""The manifests as ``kubectl kustomize`` builds them, built once per target
and handed out as fresh copies (tests mutate them)."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

from tests.k8s import validation as v
from tests.requirements import require_kubectl


@functools.cache
def _built(path: Path) -> tuple[dict, ...]:
    return tuple(v.kustomize_build(path))


def built(target: str = "k8s") -> list[dict]:
    """The documents `kubectl kustomize` builds for a target (a fresh copy each call)."""
    require_kubectl()   # fails under CI, skips elsewhere
    return copy.deepcopy(list(_built(v.KUSTOMIZE_TARGETS[target])))


def by_kind(target: str = "k8s") -> dict[str, dict]:
    """Each document under ``kind/name``, and under its kind alone when it is the only one of it."""
    docs = built(target)
    out = {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}
    assert len(out) == len(docs), [(d["kind"], d["metadata"]["name"]) for d in docs]
    kinds = [d["kind"] for d in docs]
    out.update({d["kind"]: d for d in docs if kinds.count(d["kind"]) == 1})
    return out


def rayservice(target: str = "k8s") -> dict:
    return by_kind(target)["RayService"]
