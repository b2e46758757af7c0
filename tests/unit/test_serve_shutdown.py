"""``prefix-cache serve`` stops on a burst of signals (Ctrl-C reaching a
wrapper and the process both), instead of deadlocking in its own handler."""

import os
import signal
import subprocess
import sys

import pytest

# The child leaves with os._exit: the rest of a burst may still be arriving, and an
# interpreter that finalizes puts the default handlers back, which a late SIGINT
# would meet (the child then dies of it, which is not what is under test).
CHILD = """
import os
from serve_app.cli_serve import wait_for_stop
print("stopped", wait_for_stop(poll_s=0.01, ready=lambda: print("ready", flush=True)), flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("burst", [1, 2, 50])
@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM])
def test_a_burst_of_signals_stops_the_wait(first, burst):
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        for k in range(burst):
            os.kill(child.pid, first if k == 0 else signal.SIGINT)
        out, _ = child.communicate(timeout=60)   # a deadlocked handler never gets here
    finally:
        child.kill()
    assert child.returncode == 0
    # Pending signals are delivered lowest number first, so a burst may report SIGINT.
    sent = {int(first)} | ({int(signal.SIGINT)} if burst > 1 else set())
    assert out.startswith("stopped ") and int(out.split()[1]) in sent and out.count("\n") == 1
