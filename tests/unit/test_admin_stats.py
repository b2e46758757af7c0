"""The stats endpoint's handler when the directory does not answer (restarting, or the
app going): the workers' stats still come back, with the directory's failure named,
never an exception (a 5xx)."""

import asyncio
from types import SimpleNamespace

from tests.requirements import require_module

require_module("ray")

from serve_app import admin  # noqa: E402


class DeadDirectory:
    def __init__(self):
        self.forgotten = 0

    async def ahandle(self):
        raise ConnectionError("gone")

    def forget(self):
        self.forgotten += 1


class Peer:
    async def stats(self, *, timeout_s=None):
        return {"worker": {"pid": 7}}


def core(addresses):
    async def peer_addresses(max_age_s=0.0):
        if isinstance(addresses, Exception):
            raise addresses
        return addresses

    async def client(worker_id):
        return Peer()
    return SimpleNamespace(router=SimpleNamespace(directory=DeadDirectory()), peer_addresses=peer_addresses,
                           peers=SimpleNamespace(client=client))


def test_stats_without_a_directory_still_carry_the_workers():
    c = core({"w1": "127.0.0.1:1"})
    out = asyncio.run(admin.cache_stats(c))
    assert out == {"directory": {"error": "the directory did not answer (ConnectionError)"},
                   "workers": {"w1": {"worker": {"pid": 7}}}}
    assert c.router.directory.forgotten == 1
    lost = asyncio.run(admin.cache_stats(core(TimeoutError("no answer"))))
    assert lost == {"directory": {"error": "the directory did not answer (ConnectionError)"}, "workers": {},
                    "error": "no worker list (TimeoutError: no answer)"}
