"""The packed decoder's tuned linear layouts and packed weight copies, and the checkpoint's
weights in the model's dtype, kept on local disk.

``DecoderModel.tune_linears`` spends most of a replica's engine build here: finding the
blocked kernel's summation order (``linear_layouts.blocked_order``: F.linear over a
1,024-row batch for each weight shape, 1.3 s for SmolLM2's head on one thread), reading
the tuned layouts, and cutting every weight into column panels (0.5 s, 0.5 GB). All of it
is a pure function of the checkpoint's weights, the machine (CPU, torch, thread count),
the dtype and the kernel's source, so a machine computes it once per model: ``tune``
writes it to ``<dir>/<model-id>-<key hash>.pt`` (``PackedStore``) and a later start
loads the copies with ``torch.load(mmap=True)``: the file's pages are shared through
the page cache by every replica on the machine and nothing is recomputed. The tensors
are the bytes the packing made, so the forward is bit for bit the unpacked path's.

The key names everything the copies depend on: the checkpoint (its directory, each
weight file's name, size and modification time, its ``config.json``), ``LAYOUT_VERSION``, the
tuning rule (``linear_layouts.TUNING_RULE``: a table measured by an older rule is measured again),
the dtype, CPU, torch version, thread count, ``PREFIX_CACHE_MKL_PACKED`` and the compiled
kernel's source; a file whose key differs is ignored and replaced. A model without a
``weights_id`` (the seeded test models, set by ``checkpoint.load_model`` only) is not
cached. ``PREFIX_CACHE_PACKED_CACHE=0`` turns the cache off (``bench coldstart``'s
"before" arm); ``PREFIX_CACHE_PACKED_DIR`` moves it (default
``~/.cache/prefix-cache/packed``).

The checkpoint's own weights go the same way (``map_weights``, ``keep_weights``): the
first load on a machine reads the safetensors and casts them to the model's dtype (0.45 s
for SmolLM2-135M's bfloat16 into float32 on an idle core, twice that beside serving
replicas); it then writes the parameters as they came out to
``<dir>/<model-id>-weights-<dtype>-<key hash>.pt``, and a later load maps that file instead of
casting again: a replica's parameters are the page cache's pages, one copy per machine
however many replicas read them. The key is the checkpoint's identity, the dtype, the torch
version and ``WEIGHTS_VERSION``; the values are the cast's, bit for bit.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cluster.engine import layer_loop, linear_layouts
from cluster.engine.linear_layouts import BLOCKED, PACKED, Panels

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1   # bump when what is stored (or how a copy is packed) changes
WEIGHTS_VERSION = 1  # bump when how the checkpoint's weights are cast or named changes
DIR_ENV = "PREFIX_CACHE_PACKED_DIR"
SWITCH_ENV = "PREFIX_CACHE_PACKED_CACHE"


def enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "1").strip().lower() not in ("0", "false", "no")


def cache_dir() -> Path:
    return Path(os.environ.get(DIR_ENV) or "~/.cache/prefix-cache/packed").expanduser()


def checkpoint_identity(directory: Path) -> str:
    """What the checkpoint's weights are known by without reading them: every weight
    file's name, size and modification time, and the config's bytes."""
    parts = [str(directory.resolve())] + [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in sorted(directory.glob("*.safetensors"))]
    config = directory / "config.json"
    parts.append(hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else "-")
    return "|".join(parts)


def cache_key(model: Any) -> str:
    """The full key of a model's packed copies here (see the module's docstring)."""
    from cluster.engine import kernels

    source = Path(kernels.__file__).parent / "blocked_linear.cpp"
    kernel = hashlib.sha256(source.read_bytes()).hexdigest()[:16] if source.is_file() else "-"
    return (f"v{LAYOUT_VERSION}|{linear_layouts.TUNING_RULE}|{model.weights_id}|{model.config.dtype}|"
            f"{linear_layouts._cpu_name()}|"
            f"torch {torch.__version__}|{torch.get_num_threads()} threads|"
            f"packed {int(linear_layouts.packed_enabled())}|kernel {kernel}")


class KeyedFile:
    """A file in this machine's cache (``cache_dir``), named by ``name`` and a hash of ``key``
    (the key itself is stored inside: a reader refuses a file of another key), written
    atomically: a reader sees the old file or the new one, and a process that maps the old
    one keeps its pages (never truncate a file in place)."""

    suffix = ".pt"

    def __init__(self, name: str, key: str, directory: Path | None = None):
        self.key = key
        self.directory = directory or cache_dir()
        stem = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:80] or "model"
        self.prefix = f"{stem}-"
        self.path = self.directory / f"{self.prefix}{hashlib.sha256(key.encode()).hexdigest()[:16]}{self.suffix}"

    def _write(self, write: Callable[[Path], None]) -> bool:
        """``write(tmp)`` then rename it over the file; False (logged) where the disk refused."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            write(tmp)
            tmp.replace(self.path)
            return True
        except OSError as exc:
            log.warning("%s not kept on disk (%s)", self.path.name, exc)
            return False


class PackedStore(KeyedFile):
    """One model's packed file: ``load`` (None on a miss or another key), ``save``."""

    def load(self) -> dict | None:
        """The stored state, its tensors mapped from the file; None without a file of this key."""
        try:
            state = torch.load(self.path, mmap=True, weights_only=True)
        except FileNotFoundError:
            return None
        except Exception as exc:   # a torn or foreign file: measured again and replaced
            log.warning("packed weights %s unreadable (%s); packing again", self.path, exc)
            return None
        return state if isinstance(state, dict) and state.get("key") == self.key else None

    def save(self, state: dict) -> None:
        """Write it (atomically) and remove this model's files of other keys; a read-only disk
        keeps the copies in memory only."""
        if self._write(lambda tmp: torch.save({**state, "key": self.key}, tmp)):
            for old in self.directory.glob(f"{self.prefix}*{self.suffix}"):
                if old != self.path and len(old.name) == len(self.path.name):
                    old.unlink(missing_ok=True)


def _groups(model: Any) -> tuple[list, list]:
    """The layers' (weight, bias) pairs in a fixed order, and the head's."""
    layers = [(w, b) for layer in model.layers for w, b in (
        (layer.qkv_proj, layer.qkv_bias), (layer.o_proj, layer.o_bias),
        (layer.gate_up_proj, layer.gate_up_bias), (layer.down_proj, layer.down_bias))]
    return layers, [(model.output_weight, None)]


def _measure(model: Any) -> dict:
    """Tune and pack (``linear_layouts``): the state ``tune`` stores and applies."""
    layers, head = _groups(model)
    state: dict = {"layouts": [], "orders": [], "copies": []}
    for group in (layers, head):
        layouts = linear_layouts.tuned([w for w, _ in group], model.config.dtype, [b for _, b in group])
        order = linear_layouts.blocked_order(group) if BLOCKED in layouts else None
        # Only the copies some row count of the group runs on (each costs its weight's memory or more).
        copies = {}
        if PACKED in layouts:
            copies[f"{PACKED}"] = [linear_layouts.pack(w) for w, _ in group]
        if order is not None:
            copies[f"{BLOCKED}"] = [linear_layouts.panels(w, order).panels for w, _ in group]
        state["layouts"].append(list(layouts))
        state["orders"].append(list(order) if order else [])
        state["copies"].append(copies)
    return state


def _apply(model: Any, state: dict) -> None:
    model.kernels.packed = {}
    groups = _groups(model)
    for (group, layouts, order, copies) in zip(groups, state["layouts"], state["orders"], state["copies"]):
        for layout, tensors in copies.items():
            layout = int(layout)
            for (w, _), t in zip(group, tensors):
                copy = Panels(t, w.shape[0], *order) if layout == BLOCKED else t
                model.kernels.packed[(layout, id(w))] = copy
    model.kernels.layer_layouts, model.kernels.head_layouts = (tuple(state["layouts"][0]), tuple(state["layouts"][1]))


def tune(model: Any) -> dict:
    """``DecoderModel.tune_linears``: the layouts and copies from this machine's packed
    file when its key matches, else measured, packed and stored. Returns what it did
    (``source``: "disk", "measured", or "memory" when not cached)."""
    store = None
    if getattr(model, "weights_id", None) and enabled():
        store = PackedStore(model.weights_name, cache_key(model))
        state = store.load()
        if state is not None:
            _apply(model, state)
            return {"source": "disk", "path": str(store.path)}
    state = _measure(model)
    _apply(model, state)
    if store is not None:
        store.save(state)
        return {"source": "measured", "path": str(store.path)}
    return {"source": "memory"}


def _weights_store(model: Any) -> PackedStore | None:
    if not getattr(model, "weights_id", None) or not enabled():
        return None
    key = f"weights v{WEIGHTS_VERSION}|{model.weights_id}|{model.config.dtype}|torch {torch.__version__}"
    return PackedStore(f"{model.weights_name}-weights-{model.config.dtype}", key)   # one file per dtype


def map_weights(model: Any) -> bool:
    """Point the model's parameters at this machine's file of its checkpoint's weights, mapped
    (False, nothing changed: no file of this key, or it does not fit the model's parameters)."""
    store = _weights_store(model)
    state = store.load() if store is not None else None
    if state is None:
        return False
    params, stored = dict(model.named_parameters()), state.get("params")
    if not isinstance(stored, dict) or set(stored) != set(params) or any(
            stored[n].shape != p.shape or stored[n].dtype != p.dtype for n, p in params.items()):
        log.warning("weights file %s does not fit the model's parameters; casting the checkpoint again",
                    store.path)
        return False
    for name, param in params.items():
        param.data = stored[name]
    return True


def keep_weights(model: Any) -> None:
    """After the checkpoint was read and cast: write the parameters for the next load here,
    then map them from the file (this process's copy is freed)."""
    store = _weights_store(model)
    if store is not None:
        store.save({"params": {name: p.detach() for name, p in model.named_parameters()}})
        map_weights(model)


def finish(model: Any) -> dict[str, dict[int, str]]:
    """After ``tune``: the compiled layer loop over the copies, and the layouts by row count."""
    model.kernels.layer_loop = layer_loop.compiled_layers(model)
    return {"layers": linear_layouts.describe(model.kernels.layer_layouts),
            "head": linear_layouts.describe(model.kernels.head_layouts)}
