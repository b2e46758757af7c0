"""Every part the project ships is here, and a missing one fails a CI run (``tests.requirements``).

Outside CI each check below skips where its part is missing, saying so; with ``CI=true``
(``.ci/run``) it fails, so a CI run is green only with every part present and every
CPU kernel compiled.
"""

import pytest

from tests import requirements
from tests.requirements import require


def test_a_missing_part_fails_under_ci_and_skips_elsewhere(monkeypatch):
    for value in ("true", "TRUE", "1", "yes"):
        monkeypatch.setenv("CI", value)
        with pytest.raises(pytest.fail.Exception) as failed:
            require("the widget", False, "pip install widget")
        assert str(failed.value) == ("the widget missing: pip install widget "
                                     "(CI=true: every part the project ships must be present)")
    for value in (None, "", "false", "0"):
        if value is None:
            monkeypatch.delenv("CI", raising=False)
        else:
            monkeypatch.setenv("CI", value)
        with pytest.raises(pytest.skip.Exception) as skipped:
            require("the widget", False, "pip install widget")
        assert str(skipped.value) == "the widget missing: pip install widget"
    monkeypatch.setenv("CI", "true")
    require("the widget", True, "never said")   # present: nothing happens, in CI or not


def test_a_missing_module_names_itself_and_how_to_get_it(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="the Python package 'no_such_module_here' missing: No module "
                                                     "named 'no_such_module_here'; pip install it"):
        requirements.require_module("no_such_module_here", "pip install it")
    assert requirements.require_module("json").dumps([1]) == "[1]"


@pytest.mark.parametrize("name, build", [("decode_attention", "paged_attention"), ("blocked_linear", "blocked_linear"),
                                         ("layers", "decoder_layers_paged")])
def test_every_cpu_kernel_compiles(name, build):
    from cluster.engine import kernels

    requirements.require_kernel(getattr(kernels, build)(), name)
    assert kernels.status(name) == "compiled"


def test_mooncake_is_installed():
    requirements.require_mooncake()


def test_nixl_creates_a_ucx_backend():
    requirements.require_nixl()


def test_kubectl_is_on_the_path():
    assert requirements.require_kubectl()


def test_the_openmp_runtime_is_installed():
    from pathlib import Path

    assert Path(requirements.require_intel_openmp()).name == "libiomp5.so"


def test_the_default_model_is_installed():
    requirements.require_default_model()
