"""actors.connect: joining a running Ray cluster never hangs a command."""

import threading

import pytest
import ray
from ray._private import ray_constants

from actors.connect import connect, is_loopback
from cluster.errors import InvalidInputError


@pytest.mark.parametrize("address, loopback", [
    ("127.0.0.1:6379", True), ("localhost:6379", True), ("[::1]:6379", True),
    ("10.0.0.7:6379", False), ("auto", False), ("ray-head.svc:6379", False),
])
def test_is_loopback(address, loopback):
    assert is_loopback(address) is loopback


def test_a_loopback_address_keeps_the_driver_on_loopback(monkeypatch):
    seen = {}
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)   # Ray imported without the variable
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw, switch=ray_constants.ENABLE_RAY_CLUSTER))
    connect("127.0.0.1:6379", timeout_s=5, log_to_driver=False)
    assert seen == {"address": "127.0.0.1:6379", "log_to_driver": False, "switch": False}


def test_a_remote_address_leaves_ray_as_it_is(monkeypatch):
    seen = {}
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw, switch=ray_constants.ENABLE_RAY_CLUSTER))
    connect("10.0.0.7:6379", timeout_s=5)
    assert seen == {"address": "10.0.0.7:6379", "switch": True}


def test_no_answer_within_the_timeout_is_an_error_naming_the_address(monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(ray, "init", lambda **kw: release.wait(30))   # what a hung ray.init does
    try:
        with pytest.raises(TimeoutError, match=r"no Ray cluster answered at 10\.0\.0\.7:6379 within 0\.2 s"):
            connect("10.0.0.7:6379", timeout_s=0.2)
    finally:
        release.set()


def test_a_failed_init_raises_its_own_error(monkeypatch):
    def refuse(**kw):
        raise ConnectionError("Could not find any running Ray instance")
    monkeypatch.setattr(ray, "init", refuse)
    with pytest.raises(ConnectionError, match="Could not find any running Ray instance"):
        connect("10.0.0.7:6379", timeout_s=5)


@pytest.mark.parametrize("timeout_s", [0, -1, float("nan"), "30"])
def test_the_timeout_must_be_a_positive_number(timeout_s, monkeypatch):
    monkeypatch.setattr(ray, "init", lambda **kw: pytest.fail("ray.init must not be called"))
    with pytest.raises(InvalidInputError, match="connect timeout must be a positive number"):
        connect("127.0.0.1:6379", timeout_s=timeout_s)
