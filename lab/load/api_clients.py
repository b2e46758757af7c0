"""Real clients against a running server: lm-eval's ``local-completions`` and the
official ``openai`` client's tool loop (used by ``prefix-cache bench api`` and
``tests/serve/test_real_model.py``).

``lm_eval_compare`` runs one small multiple-choice task, written to local files
(no download), twice: through ``local-completions`` pointed at the server (which
finds ``/tokenizer_info``, ``/tokenize`` and ``/detokenize`` and tokenizes
through them, then sends token-id prompts, several per request, with ``echo``
and ``logprobs``) and through lm-eval's own ``hf`` model on the same
checkpoint in float32. It returns both accuracies and every per-choice
loglikelihood of both.

``openai_tool_loop`` is the loop an agent framework runs: a forced tool call, the
tool's answer as a ``tool`` message, the next turn.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

TASK = "prefix_cache_mc"
# A small general-knowledge multiple-choice set: each question's context is shared by its
# four continuations (the workload where a prefix cache pays).
QUESTIONS = [
    ("What is the capital of France?", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("How many legs does a spider have?", ["six", "eight", "ten", "four"], 1),
    ("Which planet is known as the red planet?", ["Venus", "Jupiter", "Mars", "Saturn"], 2),
    ("What do bees make?", ["milk", "silk", "wax paper", "honey"], 3),
    ("What is the boiling point of water at sea level in Celsius?", ["100 degrees", "50 degrees",
                                                                      "0 degrees", "212 degrees"], 0),
    ("Which animal is the largest mammal?", ["the elephant", "the blue whale", "the giraffe", "the horse"], 1),
    ("What color is the sky on a clear day?", ["green", "red", "blue", "yellow"], 2),
    ("How many days are in a week?", ["five", "six", "ten", "seven"], 3),
]
PREAMBLE = ("The following are multiple choice questions about general knowledge. Answer each one with "
            "the correct choice.\n\n")

TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{preamble}}}}Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_task(directory: str | Path) -> Path:
    """The task's YAML and data under ``directory``; returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "mc.jsonl"
    with data.open("w") as f:
        for question, choices, answer in QUESTIONS:
            f.write(json.dumps({"preamble": PREAMBLE, "question": question, "choices": choices,
                                "answer": answer}) + "\n")
    (directory / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=json.dumps(str(data))))
    return directory


def _evaluate(model: str, model_args: dict, task_dir: Path, batch_size: int) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], batch_size=batch_size,
                                  task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
                                  bootstrap_iters=0, verbosity="WARNING")
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return {"acc": out["results"][TASK]["acc,none"],
            "loglikelihoods": [[float(r[0][0]) for r in s["resps"]] for s in samples]}


def lm_eval_compare(base_url: str, model_name: str, checkpoint_dir: str | Path, batch_size: int = 4,
                    api_key: str | None = None) -> dict:
    """``base_url``: the server's root (``http://host:port`` or with its route prefix)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")          # local files only: nothing to download
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if api_key:
        os.environ["OPENAI_API_KEY"] = api_key
    with tempfile.TemporaryDirectory(prefix="prefix-cache-lm-eval-") as tmp:
        task_dir = write_task(tmp)
        server = _evaluate("local-completions", {
            "model": model_name, "base_url": base_url.rstrip("/") + "/v1/completions", "num_concurrent": 1,
            "max_retries": 1, "timeout": 300, "tokenized_requests": True,
            **({"auth_token": api_key} if api_key else {})}, task_dir, batch_size)
        hf = _evaluate("hf", {"pretrained": str(checkpoint_dir), "dtype": "float32", "device": "cpu"},
                       task_dir, batch_size)
    pairs = [(a, b) for xs, ys in zip(server["loglikelihoods"], hf["loglikelihoods"]) for a, b in zip(xs, ys)]
    return {"acc_server": server["acc"], "acc_hf": hf["acc"], "choices": len(pairs),
            "max_abs_diff": max(abs(a - b) for a, b in pairs),
            "server_loglikelihoods": server["loglikelihoods"], "hf_loglikelihoods": hf["loglikelihoods"]}


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}


def openai_tool_loop(base_url: str, model_name: str, api_key: str | None = None) -> dict:
    """Two steps of an agent loop with the official client: the call forced by name,
    then the tool's result and the model's answer. Returns the second step's cached
    tokens beside the first step's prompt and reply."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key or "none", timeout=300, max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant with tools."},
        {"role": "user", "content": "What is the weather in Paris right now?"}]
    first = client.chat.completions.create(
        model=model_name, messages=messages, tools=[WEATHER_TOOL], max_tokens=48, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = first.choices[0].message
    call = message.tool_calls[0]
    arguments = json.loads(call.function.arguments)   # constrained by the grammar: always parses
    messages.append(message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id,
                     "content": json.dumps({"city": arguments["city"], "sky": "sunny", "celsius": 21})})
    second = client.chat.completions.create(model=model_name, messages=messages, tools=[WEATHER_TOOL],
                                            max_tokens=32, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens if second.usage.prompt_tokens_details else 0
    return {"finish_reason_1": first.choices[0].finish_reason, "tool": call.function.name,
            "arguments": arguments, "prompt_tokens_1": first.usage.prompt_tokens,
            "completion_tokens_1": first.usage.completion_tokens, "prompt_tokens_2": second.usage.prompt_tokens,
            "cached_tokens_2": cached, "answer_2": second.choices[0].message.content}
