"""``prefix-cache bench codec``: compressed lower tiers (``tier_codec``) against uncompressed, in one run.

    prefix-cache bench codec [--model SPEC] [--codecs none,int8] [--parts all] [--warm-mb 512]

The default model (the embedded SmolLM2-135M-Instruct, float32) and one JSON row
per part, every part comparing the codecs in the same run (what each measures:
``lab.bench.codec_parts``):

- ``bytes``: bytes per token of HOT, WARM, COLD and an L3 value per codec;
- ``sessions_held``: long sessions held whole in a fixed WARM budget (``--warm-mb``);
- ``promotion``: time per token of a promotion from WARM and from COLD;
- ``accuracy``: next-token logprobs after a prefix promoted from WARM against the
  uncompressed run, over ``--positions`` positions of real text (largest and mean |delta|);
- ``greedy``: ``--greedy-prompts`` prompts whose ``--greedy-tokens`` greedy tokens
  after a promoted prefix all agree with the uncompressed run;
- ``workload``: the long-session workload of issue 39 (in process, simulated
  clock): later-turn cached share and TTFT p50/p99, WARM at today's bytes
  uncompressed and at a quarter of them per codec;
- ``lm_eval``: lm-eval's ``local-completions`` on the local multiple-choice task
  (``lab.load.api_clients``) against one real replica (the local cluster)
  deployed once per codec with a HOT pool of a few blocks (``--lm-eval-hot-blocks``):
  lm-eval orders the requests by length, so a question's context is pushed down to
  WARM by other questions between its choices and promoted back for the next one
  (``{codec}_promoted_from_compressed_tier_tokens``: what came up through the codec);
  accuracy and loglikelihoods per codec.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import tempfile
import time

from lab.bench.common import emit, rounded

PARTS = ("bytes", "sessions_held", "promotion", "accuracy", "greedy", "workload", "lm_eval")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--codecs", default="none,int8", help="tier codecs compared (default none,int8; none first)")
    p.add_argument("--parts", default="all", help=f"comma-separated: {', '.join(PARTS)} (default all)")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--warm-mb", type=float, default=512.0, help="sessions_held: the WARM budget, MiB (default 512)")
    p.add_argument("--promote-tokens", type=int, default=2048, help="promotion: prefix length (default 2048)")
    p.add_argument("--repeats", type=int, default=5, help="promotion: repeats, medians (default 5)")
    p.add_argument("--positions", type=int, default=1200, help="accuracy: logprob positions (default 1200)")
    p.add_argument("--prefix-tokens", type=int, default=384, help="accuracy: promoted prefix per chunk (default 384)")
    p.add_argument("--continuation-tokens", type=int, default=301, help="accuracy: positions per chunk + 1")
    p.add_argument("--greedy-prompts", type=int, default=16)
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=160, help="greedy: prompt length (default 160)")
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    # The long-session workload (bench serving --workload sessions' defaults).
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=80)
    p.add_argument("--doc-tokens", type=int, default=1300)
    p.add_argument("--max-tokens", type=int, default=96, help="workload: longest reply (default 96)")
    p.add_argument("--decode-tokens", type=int, default=8,
                   help="workload: reply tokens decoded for real, the rest teacher-forced (default 8)")
    p.add_argument("--arrival-s", type=float, default=4.0)
    p.add_argument("--think-s", type=float, default=3.0)
    p.add_argument("--long-pause-share", type=float, default=0.25)
    p.add_argument("--long-pause-s", type=float, default=20.0)
    p.add_argument("--hot-tokens", type=int, default=4096, help="workload: HOT pool tokens (default 4096)")
    p.add_argument("--copy-gb-per-s", type=float, default=1.0, help="workload: background copy pacing")
    p.add_argument("--lm-eval-hot-blocks", type=int, default=6,
                   help="lm_eval: the replica's HOT blocks (default 6, a request or two: contexts go through WARM)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)


def lm_eval_part(args: argparse.Namespace, codecs: list[str]) -> dict:
    """One local cluster, the app deployed once per codec; lm-eval's local-completions twice
    each time: the first pass caches every context (KV and prompt logprobs), distinct filler
    prompts then push everything out of the small HOT into WARM, and the second pass, the
    one compared, scores every question with its context promoted back through the codec."""
    import httpx

    from lab.load.api_clients import TASK, _evaluate, write_task
    from serve_app.local import LocalCluster, free_port, prepare_model

    model = prepare_model(args.model)
    local = LocalCluster(worker_nodes=1, l3_pool_mb=0)
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    row: dict = {"part": "lm_eval", "task": f"{TASK} (8 questions x 4 choices, local files)",
                 "hot_blocks": args.lm_eval_hot_blocks, "compared": "the second pass, contexts promoted from WARM"}
    lls = {}

    def promoted() -> int:
        workers = httpx.get(url + "/v1/cache/stats", timeout=60).json()["workers"]
        return sum(_find(w, "promoted_tokens") for w in workers.values())

    try:
        with tempfile.TemporaryDirectory(prefix="prefix-cache-lm-eval-") as tmp:
            task_dir = write_task(tmp)
            for name in codecs:
                local.deploy({"num_replicas": 1, "admin_without_keys": True, "namespace": "prefix-cache-bench-codec",
                              "limits": {"max_prompt_tokens": 512, "max_tokens": 16},
                              "worker": {"model": args.model, "block_tokens": 16,
                                         "hot_blocks": args.lm_eval_hot_blocks, "warm_blocks": 1024,
                                         "tier_codec": name, "torch_threads": args.threads}}, port=port)
                began = time.perf_counter()
                lm_args = {"model": model, "base_url": url + "/v1/completions", "num_concurrent": 1,
                           "max_retries": 1, "timeout": 300, "tokenized_requests": True}
                first = _evaluate("local-completions", lm_args, task_dir, 4)
                _push_down(url, model, args.lm_eval_hot_blocks)
                before = promoted()
                out = _evaluate("local-completions", lm_args, task_dir, 4)
                row[f"{name}_first_pass_acc"] = first["acc"]
                row[f"{name}_acc"] = out["acc"]
                row[f"{name}_promoted_tokens"] = promoted() - before
                # No COLD and no L3 here: every promotion comes up from WARM, in the codec's format.
                row[f"{name}_promoted_from_compressed_tier_tokens"] = row[f"{name}_promoted_tokens"] \
                    if name != "none" else 0
                row[f"{name}_wall_s"] = rounded(time.perf_counter() - began, 1)
                lls[name] = [x for q in out["loglikelihoods"] for x in q]
    finally:
        local.shutdown()
    for name in codecs:
        if name != "none" and "none" in lls:
            row[f"{name}_acc_equal"] = row[f"{name}_acc"] == row["none_acc"]
            deltas = [abs(a - b) for a, b in zip(lls[name], lls["none"])]
            row[f"{name}_max_abs_loglikelihood_delta"] = rounded(max(deltas), 6)
            row[f"{name}_mean_abs_loglikelihood_delta"] = rounded(sum(deltas) / len(deltas), 6)
    return row


def _push_down(url: str, model: str, hot_blocks: int) -> None:
    """Distinct prompts, each as long as a request may be in HOT (its room less a block),
    one after another: what the first pass left in HOT is demoted to WARM (LRU) to make room."""
    import httpx

    rng = random.Random(7)
    for _ in range(4):
        prompt = [rng.randrange(1000, 30000) for _ in range((hot_blocks - 2) * 16 - 2)]
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1},
                       timeout=120)
        if r.status_code != 200:
            raise RuntimeError(f"a push-down prompt was refused: {r.status_code} {r.text[:300]}")


def _find(tree, key: str) -> int:
    """The first value of ``key`` anywhere in a JSON tree (0 if none)."""
    if isinstance(tree, dict):
        if key in tree and isinstance(tree[key], (int, float)):
            return tree[key]
        for v in tree.values():
            found = _find(v, key)
            if found:
                return found
    return 0


def run(args: argparse.Namespace) -> int:
    import torch

    from cluster.engine.checkpoint import ModelSpec, load_model, load_tokenizer
    from lab.bench import codec_parts as parts_
    from lab.bench.exactness import package_text

    parts = list(PARTS) if args.parts == "all" else args.parts.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"--parts: unknown {unknown}; choose from {', '.join(PARTS)} or all")
    codecs = args.codecs.split(",")
    if codecs[0] != "none" or len(codecs) < 2:
        raise ValueError("--codecs: none first, then the codecs compared with it (e.g. none,int8)")
    torch.set_num_threads(args.threads)
    loaded = load_model(dataclasses.replace(ModelSpec.parse(args.model), dtype="float32"))
    model = loaded.model
    layout = parts_.layout_of(model)
    tokens = load_tokenizer(loaded).encode(package_text())
    head = {"bench": "codec", "model": loaded.model_id}
    with tempfile.TemporaryDirectory(prefix="prefix-cache-codec-") as disk_dir:
        for part in parts:
            began = time.perf_counter()
            if part == "bytes":
                rows = [parts_.bytes_part(layout, codecs, args.block_tokens)]
            elif part == "sessions_held":
                rows = [parts_.sessions_held_part(layout, codecs, args)]
            elif part == "promotion":
                rows = parts_.promotion_part(layout, codecs, args, disk_dir)
            elif part == "accuracy":
                rows = [parts_.accuracy_part(model, tokens, codecs, args)]
            elif part == "greedy":
                rows = [parts_.greedy_part(model, tokens, codecs, args)]
            elif part == "workload":
                rows = parts_.workload_part(model, codecs, args, disk_dir)
            else:
                rows = [lm_eval_part(args, codecs)]
            for row in rows:
                emit({**head, **row, "part_wall_s": rounded(time.perf_counter() - began, 1)})
    return 0
