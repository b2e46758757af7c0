"""The real default model over HTTP: its id, its answers, its text, its multi-turn reuse.

One replica of the embedded SmolLM2-135M-Instruct (converted once into the
local safetensors cache) behind two replicas of the real ingress on the
loopback cluster (each turn of a chat may reach either: what one ingress
learned of a reply must serve the other). Greedy decoding, so every answer
is reproducible.
"""

import json

import httpx
import pytest

from tests.requirements import require_module

pytestmark = pytest.mark.distributed

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def base_url(ray_loopback_cluster):
    from ray import serve

    from serve_app.app import build_app
    from serve_app.local import free_port, prepare_model

    assert prepare_model(None) == MODEL   # converts the GGUF once, before the replica starts
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"num_replicas": 1, "ingress_replicas": 2, "namespace": "prefix-cache-real-model-test",
            "limits": {"max_prompt_tokens": 2048, "max_tokens": 64},
            "worker": {"hot_blocks": 256, "warm_blocks": 128, "block_tokens": 16, "torch_threads": 2}}
    serve.run(build_app(args), name="prefix-cache-real", route_prefix="/real")
    yield f"http://127.0.0.1:{port}/real"
    serve.shutdown()   # the next module starts Serve on a port of its own


def chat(url, messages, **kw):
    r = httpx.post(url + "/v1/chat/completions", timeout=120,
                   json={"model": MODEL, "messages": messages, "max_tokens": 24, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def stream_chat(url, messages, **kw):
    chunks = []
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120,
                      json={"model": MODEL, "messages": messages, "max_tokens": 24, "stream": True, **kw}) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunks.append(json.loads(line[6:]))
    return chunks


def test_models_lists_the_real_model(base_url):
    r = httpx.get(base_url + "/v1/models", timeout=30)
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [MODEL]


def test_real_answer_and_eos_ends_it(base_url):
    body = chat(base_url, [{"role": "user", "content": "What is the capital of France?"}], max_tokens=48)
    text = body["choices"][0]["message"]["content"]
    assert "Paris" in text
    # The model ends its turn with <|im_end|> (EOS) before 48 tokens: finish_reason "stop",
    # and the control token is not part of the text.
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] < 48 and "<|im_end|>" not in text


def test_length_finish_reason(base_url):
    body = chat(base_url, [{"role": "user", "content": "Write a long story about a dragon."}], max_tokens=5)
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 5


def test_stop_string_cuts_before_it(base_url):
    messages = [{"role": "user", "content": "Describe the city of Lyon in two sentences."}]
    full = chat(base_url, messages, max_tokens=40)["choices"][0]["message"]["content"]
    assert len(full) > 20, full
    stop = full[len(full) // 2:len(full) // 2 + 4]        # a string the model will write again
    cut_at = full.index(stop)
    body = chat(base_url, messages, max_tokens=40, stop=[stop, "zzz-never"])
    assert body["choices"][0]["message"]["content"] == full[:cut_at]
    assert body["choices"][0]["finish_reason"] == "stop"
    streamed = stream_chat(base_url, messages, max_tokens=40, stop=stop)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in streamed) == full[:cut_at]
    assert streamed[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("prompt", [
    "Répète exactement: « Noël à Zürich, déjà vu, garçon, façade ».",
    "请用中文回答：日本的首都是哪里？",
    "Reply with three emoji about cooking 🍳👩‍🍳🔥 and the flag 🇫🇷.",
])
def test_streamed_text_equals_non_streamed_multibyte(base_url, prompt):
    messages = [{"role": "user", "content": prompt}]
    plain = chat(base_url, messages, max_tokens=32)["choices"][0]["message"]["content"]
    chunks = stream_chat(base_url, messages, max_tokens=32)
    pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert "".join(pieces) == plain
    # No partial character is ever streamed. Only when max_tokens cuts the last character
    # in half does the end carry U+FFFD, as in the non-streamed text.
    texts = [p for p in pieces if p]
    if plain.endswith("\ufffd"):
        texts[-1] = texts[-1].rstrip("\ufffd")
    assert all("\ufffd" not in p for p in texts), pieces
    assert any(ord(ch) > 127 for ch in plain), plain          # the model did answer with non-ASCII text


def test_six_turn_chat_reuses_prompt_and_reply(base_url):
    """The client appends the reply text and a new message each turn: the new
    prompt's cached tokens cover the previous prompt and reply, whichever of the
    two ingress replicas each turn reaches."""
    questions = ["Hi! Who are you?", "What is a prefix cache?", "Give me an example with numbers.",
                 "How does that help a chat like ours?", "Say it in one sentence.", "Thanks, bye!"]
    messages = [{"role": "system", "content": "You are a concise assistant."}]
    previous, ratios, ingresses = 0, [], set()
    for question in questions:
        messages.append({"role": "user", "content": question})
        body = chat(base_url, messages, max_tokens=32)
        ingresses.add(body["prefix_cache"]["ingress_id"])
        usage = body["usage"]
        if previous:
            ratios.append(min(usage["prompt_tokens_details"]["cached_tokens"], previous) / previous)
        previous = usage["prompt_tokens"] + usage["completion_tokens"]
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    assert len(ratios) == 5 and min(ratios) >= 0.95, (ratios, ingresses)
    assert len(ingresses) <= 2 and None not in ingresses


def test_admin_endpoints_are_off_without_keys(base_url):
    """No key configured and admin_without_keys not set: flush and policy refuse everyone."""
    for path, body in (("/v1/cache/flush", {}), ("/v1/admin/policy", {"policy": "round_robin"})):
        r = httpx.post(base_url + path, json=body, timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled", r.text


# ------------------------------------------------------------ the API's real clients
def test_echo_and_logprobs_equal_transformers_own_forward(base_url):
    """Prompt logprobs (echo) and the generated tokens' logprobs and top-3 equal
    log_softmax of transformers' forward of the same checkpoint in float32, the
    second time with the prompt's logprobs read from beside its cached KV."""
    import torch
    import transformers

    from cluster.engine.checkpoint import resolve_checkpoint

    text = "The quick brown fox jumps over the lazy dog. A prefix cache keeps the keys and values"
    ids = httpx.post(base_url + "/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(resolve_checkpoint(None)), dtype=torch.float32)
    for attempt in range(2):
        r = httpx.post(base_url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": text, "max_tokens": 6, "echo": True, "logprobs": 3})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        out = choice["token_ids"]
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids + out])).logits[0].float(), -1)
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids) + len(out)
        for pos in range(1, len(ids) + len(out)):
            token = (ids + out)[pos]
            assert abs(lp["token_logprobs"][pos] - float(ref[pos - 1, token])) < 1e-4, (attempt, pos)
            got = sorted(lp["top_logprobs"][pos].values(), reverse=True)[:3]
            assert torch.allclose(torch.tensor(got), torch.topk(ref[pos - 1], 3).values, atol=1e-4), (attempt, pos)
        if attempt == 1:
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(ids) - 16


def test_lm_eval_local_completions_equals_its_hf_model(base_url):
    """lm-eval's local-completions against the server (remote tokenizer, batched
    token-id prompts, echo + logprobs) and lm-eval's hf model on the same weights:
    the same accuracy and per-choice loglikelihoods within 1e-4."""
    require_module("lm_eval")
    from cluster.engine.checkpoint import resolve_checkpoint
    from lab.load.api_clients import QUESTIONS, lm_eval_compare

    result = lm_eval_compare(base_url, MODEL, resolve_checkpoint(None), batch_size=4)
    assert result["choices"] == 4 * len(QUESTIONS)
    assert result["acc_server"] == result["acc_hf"]
    assert result["max_abs_diff"] < 1e-4, result
    assert [max(range(4), key=xs.__getitem__) for xs in result["server_loglikelihoods"]] == \
        [max(range(4), key=xs.__getitem__) for xs in result["hf_loglikelihoods"]]


def test_openai_client_tool_loop_reuses_the_first_step(base_url):
    """The official client's agent loop: a call forced by name parses, and the next
    step's cached tokens cover the first step's prompt and reply (all but the
    reply's stop token, which was sampled but never run through the model),
    whichever of the two ingress replicas each step reaches."""
    require_module("openai")
    from lab.load.api_clients import openai_tool_loop

    r = openai_tool_loop(base_url, MODEL)
    assert r["finish_reason_1"] == "tool_calls" and r["tool"] == "get_weather"
    assert isinstance(r["arguments"]["city"], str) and set(r["arguments"]) == {"city"}
    assert r["cached_tokens_2"] >= r["prompt_tokens_1"] + r["completion_tokens_1"] - 1, r
    assert r["prompt_tokens_2"] > r["prompt_tokens_1"] + r["completion_tokens_1"]


def test_bench_api_parts_print_their_figures(base_url):
    """``prefix-cache bench api``'s structured and echo parts against this server
    (the command starts its own; n_fork and lm_eval read admin stats, off here)."""
    import argparse

    from lab.bench import api as bench_api

    p = argparse.ArgumentParser()
    bench_api.add_arguments(p)
    args = p.parse_args(["--repeats", "1", "--max-tokens", "6", "--prompt-tokens", "64"])
    api = bench_api.Api(base_url, MODEL)
    row = bench_api.structured(api, args)
    for kind in ("unconstrained", "regex", "json_schema"):
        assert row[f"ms_per_token_{kind}"] > 0 and row[f"tokens_{kind}"] >= 3
    assert set(row) >= {"overhead_pct_regex", "overhead_pct_json_schema", "other_overhead_pct_beside_regex"}
    prompts = [f"Prompt number {i}: " + "tell me about caches. " * 8 for i in range(11)]
    row = bench_api.echo(api, prompts, args)
    assert row["cold_echo_ms"] > 0 and row["cached_echo_ms"] > 0 and "cached_echo_overhead_pct" in row
