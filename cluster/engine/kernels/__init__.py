"""Compiled CPU kernels of the packed decoder, built on first use with torch's C++ extension loader.

``decode_attention`` (``decode_attention.cpp``): one call per layer for every
sequence of a step that decodes one token, each in its own head-major KV
buffer: the token's K/V written in place, every query head attending over its
sequence's keys, the work split over (sequence, KV head) on ATen's threads.
In the torch path that is a handful of small ops per sequence per layer, whose
dispatch costs more than the arithmetic on a CPU (about 480 calls a step for
16 sequences of a 30-layer model). Float32 on the CPU; its results equal the
torch path's to about 1e-7.

The build takes about a minute once per machine (cached under
``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``; concurrent
builds wait on the loader's lock). When it cannot be built (no compiler,
``PREFIX_CACHE_KERNELS=0``), ``decode_attention()`` is None, the reason is
logged once, and the model keeps its torch path.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ENV_VAR = "PREFIX_CACHE_KERNELS"
_lock = threading.Lock()
_state: dict[str, Any] = {"module": None, "tried": False, "error": None}


def decode_attention() -> Any:
    """The compiled ``decode_attention`` function, or None (see the module docstring)."""
    with _lock:
        if not _state["tried"]:
            _state["tried"] = True
            if os.environ.get(ENV_VAR, "1") in ("0", "false", "no"):
                _state["error"] = f"{ENV_VAR}=0"
            else:
                try:
                    from torch.utils.cpp_extension import load

                    _state["module"] = load(
                        name="prefix_cache_decode_attention",
                        sources=[str(Path(__file__).with_name("decode_attention.cpp"))],
                        extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
                except Exception as exc:   # no compiler or headers: the torch path serves, slower
                    _state["error"] = f"{type(exc).__name__}: {exc}"
            if _state["error"]:
                log.warning("decode attention kernel unavailable (%s); using the torch path", _state["error"])
        module = _state["module"]
    return None if module is None else module.decode_attention


def status() -> str:
    """'compiled', 'not built yet', or why it is unavailable."""
    if not _state["tried"]:
        return "not built yet"
    return "compiled" if _state["module"] is not None else f"unavailable: {_state['error']}"
