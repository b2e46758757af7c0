"""The JSON lines a ``prefix-cache`` command prints: one record per line on stdout, flushed,
and appended to ``--results FILE`` as well where the command line names one."""

from __future__ import annotations

import json
import sys
from typing import Any

# Where every command's JSON lines also go (``--results FILE``: appended), besides stdout.
RESULTS_FILE: str | None = None


def emit(record: dict[str, Any]) -> None:
    """Print one JSON line (the commands' public output format) and flush; with
    ``--results FILE`` the line is appended to that file too."""
    line = json.dumps(record, sort_keys=False) + "\n"
    sys.stdout.write(line)
    sys.stdout.flush()
    if RESULTS_FILE is not None:
        with open(RESULTS_FILE, "a", encoding="utf-8") as f:
            f.write(line)
