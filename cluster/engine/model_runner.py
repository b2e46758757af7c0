"""The model runner: one packed forward over a step's plan, KV read and written in place.

Each planned request brings its lease's slot table (``KVLease.slots``: the HOT
pool slot of every position it holds, then of the room it reserved for this
step's tokens). A model with ``forward_paged`` (the packed decoder) attends
over the HOT pool through those tables and writes the new tokens' K/V straight
into the reserved slots: a running request's KV exists once, in the cache's
blocks, whatever its length. Any other model (the tests' ``transformers`` reference)
gets its past gathered from the pool (``KVLease.read``) and its new KV written
back through the lease. Either way the lease is told what was written, and the
runner returns each request's logits: every computed row's when the plan asks
(prompt logprobs, ``keep_logits``), the last row's otherwise.

It also computes a finished request's last token's KV (``final_tokens``), for
the scheduler to commit the whole sequence. It sees the plan and the leases'
slot tables; never a node, an extent or a queue.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from cluster.engine.plan import StepOutput, StepPlan

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: Any, hot_pool: Any, *, decode_kernel: bool = True, cuda_graphs: bool = True):
        """``decode_kernel``: the packed decoder attends every request of a step with a few new
        tokens in one compiled call per layer (``cluster.engine.kernels``) where it can be built
        (Triton on CUDA); the torch path otherwise. ``cuda_graphs``: on CUDA, with that kernel,
        steps of decodes alone replay a graph captured per batch-size bucket."""
        self.model = model
        self.pool = hot_pool
        self.paged = hasattr(model, "forward_paged") and hot_pool.tensor is not None
        self.decode_kernel = model.use_decode_kernel(decode_kernel) if hasattr(model, "use_decode_kernel") \
            else False
        self.cuda_graphs = model.use_cuda_graphs(cuda_graphs) if hasattr(model, "use_cuda_graphs") else False
        # The faster of MKL's two linear layouts for each row count, measured on this machine.
        self.linear_layouts = model.tune_linears() if hasattr(model, "tune_linears") else {}

    def run(self, plan: StepPlan) -> list[torch.Tensor]:
        """The step's forward; each request's new KV ends up in its reserved slots (its lease
        told). Returns each request's logits."""
        items = plan.items
        tokens = [torch.tensor(item.tokens) for item in items]
        if self.paged:
            logits = self.model.forward_paged([(t, item.start, item.request.lease.slots())
                                               for t, item in zip(tokens, items)],
                                              self.pool.tensor, last_logits_only=not plan.all_logits)
            for item in items:
                item.request.lease.written(item.num_tokens)
            return logits
        # Every row's logits: the sampler reads the last, so this path needs no last-row option.
        batch = [(t, item.start, item.request.lease.read() if item.start else None) for t, item in zip(tokens, items)]
        outputs = self.model.forward_batch(batch)
        for item, (_, new_kv) in zip(items, outputs):
            item.request.lease.write(new_kv)
        return [logits for logits, _ in outputs]

    def execute(self, plan: StepPlan) -> StepOutput:
        """``run``, timed; a failed forward is the step's error (it fails the step's requests,
        never the cache or the engine)."""
        decodes_only = plan.decodes_only   # before the update appends the step's tokens
        began = time.perf_counter()   # wall time, whatever the engine's clock is: what a step really costs
        try:
            logits = self.run(plan)
        except Exception as exc:
            return StepOutput(None, f"model forward failed: {exc}", began)
        return StepOutput(logits, None, began, (time.perf_counter() - began) * 1e3, decodes_only)

    def final_tokens(self, plan: StepPlan) -> set[int]:
        """The KV of finished requests' last sampled tokens (``Scheduler.final_token_plan``:
        one token each, its slot reserved), one forward alone per request; the ids of the
        requests whose token was computed (a failure leaves the rest of its sequence to be
        cached all the same)."""
        done = set()
        for item in plan.items:
            try:
                self.run(StepPlan([item]))
            except Exception as exc:
                log.warning("could not compute the final token of request %s: %s", item.request.request_id, exc)
                continue
            done.add(id(item.request))
        return done
