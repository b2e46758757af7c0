"""``prefix-cache bench chat``: multi-turn KV reuse with a real tokenizer.

A chat client sends the whole conversation every turn, the model's earlier
replies as text. Re-tokenizing that text need not give back the ids the model
generated, and where it does not, the reply's cached KV is not reused. This
bench runs the same chats through the real engine and model with the prompt
built two ways:

- ``bridged``: the ingress's ``ChatPromptBuilder`` with its ``ReplyMemory``
  (each message tokenized alone, a remembered reply as its generated ids);
- ``retokenized``: the tokenizer's own chat template over the whole text, what
  a server without the bridge does.

With ``--temperature`` above 0 (seeded) the replies are sampled, which makes
tokenizations the tokenizer would not choose more frequent. Per turn after
the first, ``reuse_ratio`` = cached prompt tokens / tokens of
the previous turn's prompt and reply (which the new prompt starts with, as
text). Rows print the mean over turns, the fraction of follow-up turns whose
prompt starts with the previous prompt + generated ids exactly
(``exact_prefix_turns``) and the tokens recomputed.
"""

from __future__ import annotations

import argparse

import torch

from cluster.cache.kv_pool import KVLayout
from cluster.cache.tiered import TierConfig, TieredCache
from cluster.engine.checkpoint import ModelSpec, load_model, load_tokenizer
from cluster.engine.engine import Engine, SamplingParams
from cluster.engine.text import ChatPromptBuilder, ReplyMemory
from lab.bench.common import emit, rounded

SYSTEM = ("You are a concise assistant. Answer in two or three sentences, with concrete numbers and "
          "examples where they help.")
QUESTIONS = [
    "What is a prefix cache in LLM serving?", "Why does the second turn of a chat start faster?",
    "Give me a recipe for pancakes with 200 g of flour.", "How would you say that in French? (é, è, ç)",
    "Write one line of Japanese: 日本語で一文を書いてください。", "Summarize our conversation with an emoji 👍.",
    "What is the capital of Australia?", "Name three rivers in Europe.", "And which one is the longest?",
    "How many minutes are in a week?", "Explain KV cache eviction to a child.", "Thanks! Anything else?",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=48, help="reply tokens per turn (greedy)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (default 0: greedy); sampled replies are more often "
                        "tokenized in ways the tokenizer would not choose")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--block-tokens", type=int, default=16)


def run_arm(arm: str, loaded, tokenizer, args) -> dict:
    c = loaded.model.config
    cache = TieredCache(TierConfig(hot_blocks=4096, block_tokens=args.block_tokens, device="cpu"),
                        KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, c.dtype), vocab_size=c.vocab_size)
    engine = Engine(loaded.model, cache)
    builder = ChatPromptBuilder(tokenizer, ReplyMemory() if arm == "bridged" else None)
    stop_ids = tuple(tokenizer.stop_token_ids)
    ratios, exact, follow_ups, recomputed, prompt_tokens = [], 0, 0, 0, 0
    for session in range(args.sessions):
        namespace = f"session-{session}"
        messages = [{"role": "system", "content": SYSTEM}]
        previous: list[int] = []
        for turn in range(args.turns):
            messages.append({"role": "user", "content": QUESTIONS[(session * args.turns + turn) % len(QUESTIONS)]})
            prompt = (builder.build(messages, namespace).ids if arm == "bridged"
                      else tokenizer.apply_chat_template(messages))
            params = SamplingParams(max_tokens=args.max_tokens, stop_token_ids=stop_ids,
                                    temperature=args.temperature, seed=args.seed + 1000 * session + turn)
            req = engine.generate(prompt, params, namespace=namespace)
            reply_ids = req.output[:-1] if req.output and req.output[-1] in stop_ids else req.output
            text = tokenizer.decode(reply_ids)
            builder.remember_reply(namespace, text, req.output)
            prompt_tokens += len(prompt)
            recomputed += len(prompt) - req.cached_tokens
            if previous:
                follow_ups += 1
                ratios.append(min(req.cached_tokens, len(previous)) / len(previous))
                exact += prompt[:len(previous)] == previous
            previous = prompt + req.output
            messages.append({"role": "assistant", "content": text})
    return {"bench": "chat", "impl": arm, "model": loaded.model_id, "sessions": args.sessions, "turns": args.turns,
            "temperature": args.temperature,
            "reuse_ratio": rounded(sum(ratios) / len(ratios)) if ratios else 0.0,
            "reuse_ratio_min": rounded(min(ratios)) if ratios else 0.0,
            "exact_prefix_turns": rounded(exact / follow_ups) if follow_ups else 0.0,
            "prompt_tokens": prompt_tokens, "recomputed_tokens": recomputed,
            "fallbacks": builder.fallbacks}


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    spec = ModelSpec.parse(args.model)
    loaded = load_model(spec)
    tokenizer = load_tokenizer(spec)
    rows = [run_arm(arm, loaded, tokenizer, args) for arm in ("bridged", "retokenized")]
    rows[0]["recomputed_tokens_saved"] = rows[1]["recomputed_tokens"] - rows[0]["recomputed_tokens"]
    for row in rows:
        emit(row)
    return 0
