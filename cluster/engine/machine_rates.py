"""A machine's measured rates for one model, kept on local disk from one replica's process to the next.

A worker starts on rates it did not measure itself: a live peer's (``actors.core``), or,
with no peer, a prior it measures before serving (``actors.calibration.prior_rates``: two
prefills and one WARM promotion, 0.4 s on an idle core, 2.6-3.5 s beside Ray's own
start-up on a 2-core VM). While it serves, its engine and cache measure the real ones
(``RateRefiner``). Those are what this module keeps: ``<dir>/<model-id>-rates-<key hash>.json``
in the packed weights' directory (``cluster.engine.packed_weights``), and a later start on
the machine with no peer takes them instead of measuring a prior (``rates_source: disk``).

The key is everything the packed copies depend on (the checkpoint, the dtype, the CPU, torch,
the thread count, the kernel), the device, and the KV's bytes per token and block size, so
a rate kept for another machine, model, thread count or KV shape is never read. A model
without a checkpoint (the seeded test models) keeps nothing, and ``PREFIX_CACHE_PACKED_CACHE=0``
turns this off with the rest of the cache. Only rates a worker measured itself are kept (a
peer's or the prior's are not this machine's), and a start completes the rest as calibration
does (``actors.calibration.completed_rates``). The rates are a starting point like a peer's:
the refiner replaces each as soon as the engine measures it.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from typing import Any

from cluster.engine import packed_weights

log = logging.getLogger(__name__)

RATES_VERSION = 1   # bump when what a rate means changes
# The CostModel's rates a file may hold (tokens per second each).
RATE_NAMES = ("prefill_tokens_per_s", "warm_promote_tokens_per_s", "cold_promote_tokens_per_s",
              "transfer_tokens_per_s", "l3_fetch_tokens_per_s")


def device_name(device: str) -> str:
    """The device as the key names it: the GPU's model on CUDA (rates differ between GPUs)."""
    if device.startswith("cuda"):
        import torch

        return f"cuda {torch.cuda.get_device_name(torch.device(device))}"
    return device


class RatesFile(packed_weights.KeyedFile):
    """One model's rates on this machine: ``load`` (None on a miss, another key or a bad file), ``save``."""

    suffix = ".json"

    def load(self) -> dict[str, float] | None:
        """The kept rates by name (each a positive finite number measured by a worker, names from
        ``RATE_NAMES``, the prefill rate among them), or None."""
        try:
            state = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("kept rates %s unreadable (%s); measuring", self.path, exc)
            return None
        rates = state.get("rates") if isinstance(state, dict) and state.get("key") == self.key else None
        if not isinstance(rates, dict) or not rates.get("prefill_tokens_per_s"):
            return None
        if any(name not in RATE_NAMES or isinstance(v, bool) or not isinstance(v, (int, float))
               or not math.isfinite(v) or v <= 0 for name, v in rates.items()):
            log.warning("kept rates %s hold a bad value; measuring", self.path)
            return None
        return {name: float(v) for name, v in rates.items()}

    def save(self, rates: Mapping[str, float]) -> None:
        """Keep ``rates`` (what a worker measured itself; only those), written atomically; a
        read-only disk keeps nothing."""
        rates = {name: float(v) for name, v in rates.items() if name in RATE_NAMES and v and v > 0}
        self._write(lambda tmp: tmp.write_text(json.dumps({"key": self.key, "rates": rates})))


def rates_file(model: Any, device: str, bytes_per_token: int, block_tokens: int) -> RatesFile | None:
    """The file of ``model``'s rates on this machine for this KV shape (None: nothing is kept:
    a model without a checkpoint, or the cache turned off)."""
    if not getattr(model, "weights_id", None) or not packed_weights.enabled():
        return None
    key = (f"rates v{RATES_VERSION}|{packed_weights.cache_key(model)}|{device_name(device)}|"
           f"{bytes_per_token} bytes a token|{block_tokens} a block")
    return RatesFile(f"{model.weights_name}-rates", key)
