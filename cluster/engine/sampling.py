"""What a request samples from one position's logits: its processors, the draw, its logprobs.

Order (vLLM v1's): the grammar's token mask (structured output), ``min_tokens``
(stop tokens masked until that many were generated), ``logit_bias``, the
penalties (``repetition_penalty`` over prompt and output, as transformers
applies it; ``frequency_penalty`` and ``presence_penalty`` over the output, as
OpenAI defines them), then greedy (argmax) or ``temperature``, ``min_p``,
``top_k``, ``top_p`` and a draw from the request's generator. A request that
sets none of them takes exactly the path of ``sample``
(same floats, same draws), so seeded sampling stays a function of (seed,
position) and a preempted or resumed request continues exactly.

Logprobs are the model's own: ``log_softmax`` of the raw logits, before any
processor, temperature or mask (vLLM's default ``raw_logprobs``), so they are
comparable across requests and equal the model's reference forward.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from cluster.protocol import SamplingParams

NEG_INF = float("-inf")


# The nucleus (top_p) is looked for among the most likely tokens first, a top-k of this many
# candidates then of ``NUCLEUS_WIDE``, instead of a sort of the whole vocabulary: a language
# model's nucleus at a top_p of 0.9-0.95 is usually tens or hundreds of tokens, and a top-k of
# 1,024 over a 49,152-token vocabulary takes 0.11 ms where the sort took 4.2 ms (two cores). A
# flat distribution whose nucleus is wider still (a high temperature) is sorted whole, as before.
NUCLEUS_CANDIDATES = 1024
NUCLEUS_WIDE = 4096


def sample(
    logits_row: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> int:
    """Next token id: greedy when temperature == 0, else temperature + nucleus sampling.

    Top-p keeps the smallest set of most likely tokens whose probability reaches
    top_p (the most likely token always). Ties sort stably (by token id), so a seeded
    generator gives the same token on every run. The draw is one uniform number from
    ``generator`` a token, mapped through the kept probabilities' cumulative sum (inverse
    CDF): it costs one random number where ``torch.multinomial`` drew one a vocabulary entry
    (1.2 ms a token of a 49,152-token vocabulary on two cores, against 0.14 ms).
    """
    if not isinstance(logits_row, torch.Tensor) or logits_row.dim() != 1 or logits_row.numel() == 0:
        raise ValueError(f"logits_row must be a non-empty 1-D tensor, got {logits_row!r:.80}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    logits = logits_row.float()
    if torch.isnan(logits).any():
        raise ValueError("logits_row contains NaN")
    if temperature == 0:
        return int(torch.argmax(logits))
    if generator is not None and generator.device != logits.device:
        logits = logits.to(generator.device)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = _nucleus_candidates(probs, top_p)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep = before < top_p
        keep[0] = True   # the most likely token always: a top_p below float32's range compares as 0
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        return int(order[_draw(sorted_probs, generator, logits)])
    return _draw(probs, generator, logits)


def _nucleus_candidates(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The most likely tokens in descending order, ties by token id (a stable sort's order),
    enough of them to hold the nucleus: the top ``NUCLEUS_CANDIDATES`` (then ``NUCLEUS_WIDE``)
    where their probabilities reach ``top_p`` and no token outside ties with the last one
    (then no token outside can be in the nucleus), else the whole vocabulary sorted."""
    n = probs.numel()
    for k in (NUCLEUS_CANDIDATES, NUCLEUS_WIDE):
        if k >= n:
            break
        values, ids = torch.topk(probs, k + 1)
        if not values[k - 1] > values[k]:   # a tie across the edge (or NaN): sort it all
            break
        by_id = torch.argsort(ids[:k])
        values, ids = values[:k][by_id], ids[:k][by_id]
        values, order = torch.sort(values, descending=True, stable=True)
        if float(torch.cumsum(values, dim=-1)[-1]) >= top_p:
            return values, ids[order]
    return torch.sort(probs, descending=True, stable=True)


def _draw(probs: torch.Tensor, generator: torch.Generator | None, logits: torch.Tensor) -> int:
    """An index of ``probs`` (non-negative, not all zero) drawn in proportion to them: one
    uniform number from ``generator`` through their cumulative sum. A zero entry is never
    drawn. Probabilities that are not a distribution (an infinite logit) give the argmax of
    ``logits``, as greedy would."""
    cumulative = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    total = float(cumulative[-1])
    if not math.isfinite(total) or total <= 0:
        return int(torch.argmax(logits))
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    i = int(torch.searchsorted(cumulative, torch.tensor(u * total, dtype=torch.float64), right=True))
    if i >= probs.numel():   # u * total rounded up to the total: the last token with a probability
        i = int(torch.nonzero(probs > 0)[-1])
    return i


def needs_processing(params: SamplingParams) -> bool:
    """Whether any processor or filter beyond temperature and top_p applies."""
    return bool(params.min_tokens or params.logit_bias or params.repetition_penalty != 1.0
                or params.frequency_penalty or params.presence_penalty or params.top_k > 0 or params.min_p > 0)


class Penalties:
    """A request's penalty state across its tokens: which ids its prompt and output hold
    (``repetition_penalty``) and how often each of its own tokens came (``frequency_penalty``,
    ``presence_penalty``), as tensors over the vocabulary, brought up to date with the tokens
    added since the last call. Rebuilding them every token from Python sets cost 0.4-0.7 ms
    a token at a 2,000-token prompt on the engine thread (two cores), per stream; the
    penalties applied over the whole vocabulary give the same floats where they apply and
    leave the rest as they are. Rebuilt whole when the request's prompt or output is not the
    one it followed (another list, or a shorter one). Engine thread only."""

    __slots__ = ("_done", "_output", "_prompt", "counts", "seen")

    def __init__(self) -> None:
        self.seen: torch.Tensor | None = None     # bool [vocab]: in the prompt or the output
        self.counts: torch.Tensor | None = None   # float32 [vocab]: the request's own tokens
        self._prompt: Any = None
        self._output: Any = None
        self._done = 0   # output tokens counted

    def update(self, prompt: Sequence[int], output: Sequence[int], params: SamplingParams, vocab: int) -> None:
        if self.seen is None or self._prompt is not prompt or self._output is not output or \
                self._done > len(output) or self.seen.numel() != vocab:
            self.seen = torch.zeros(vocab, dtype=torch.bool)
            self.counts = torch.zeros(vocab, dtype=torch.float32)
            self.seen[torch.tensor(list(prompt), dtype=torch.long)] = True
            prior = min(params.prior_output, len(prompt))
            if prior:   # a resumed request's tokens before the resume are its own too
                self._count(prompt[len(prompt) - prior:])
            self._prompt, self._output, self._done = prompt, output, 0
        if self._done < len(output):
            new = output[self._done:]
            self.seen[torch.tensor(list(new), dtype=torch.long)] = True
            self._count(new)
            self._done = len(output)

    def _count(self, tokens: Sequence[int]) -> None:
        ids = torch.tensor(list(tokens), dtype=torch.long)
        self.counts.index_add_(0, ids, torch.ones(len(ids), dtype=torch.float32))

    def apply(self, logits: torch.Tensor, params: SamplingParams, own: int) -> torch.Tensor:
        """``logits`` after the repetition penalty and the frequency and presence penalties
        (``own``: how many tokens of its own the request has)."""
        pen = params.repetition_penalty
        if pen != 1.0:
            logits = torch.where(self.seen, torch.where(logits > 0, logits / pen, logits * pen), logits)
        if (params.frequency_penalty or params.presence_penalty) and own:
            present = (self.counts > 0).to(torch.float32)
            logits = logits - (params.frequency_penalty * self.counts + params.presence_penalty * present)
        return logits


def process(logits_row: torch.Tensor, params: SamplingParams, prompt: Sequence[int], output: Sequence[int],
            mask: torch.Tensor | None = None, penalties: Penalties | None = None) -> torch.Tensor:
    """The logits after the mask, min_tokens, logit_bias and the penalties (a float32 copy);
    ``penalties``: the request's state, kept across its tokens (None: built for this call)."""
    logits = logits_row.float().clone()
    if mask is not None:   # a boolean [vocab]: True where the grammar allows the token
        logits.masked_fill_(~mask, NEG_INF)
    own = min(params.prior_output, len(prompt)) + len(output)
    if params.min_tokens and own < params.min_tokens and params.stop_token_ids:
        ids = torch.tensor([t for t in params.stop_token_ids if 0 <= t < logits.numel()], dtype=torch.long)
        logits[ids] = NEG_INF
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        logits[ids] += torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)
    if params.repetition_penalty != 1.0 or ((params.frequency_penalty or params.presence_penalty) and own):
        penalties = penalties if penalties is not None else Penalties()
        penalties.update(prompt, output, params, logits.numel())
        logits = penalties.apply(logits, params, own)
    return _finite(logits)


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """No NaN and no +inf (a repetition penalty near 0 divides a logit past float32's
    range): +inf becomes the largest finite value, a NaN is never chosen."""
    big = torch.finfo(logits.dtype).max
    return torch.nan_to_num(logits, nan=NEG_INF, posinf=big, neginf=NEG_INF)


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Draw from processed logits: argmax when greedy; else temperature, min_p, top_k, top_p."""
    if params.greedy:
        return int(torch.argmax(logits))
    if generator is not None and generator.device != logits.device:
        logits = logits.to(generator.device)
    logits = _finite(logits / params.temperature)
    if params.min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), NEG_INF)
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    return sample(logits, 1.0, params.top_p, generator)


def sample_token(logits_row: torch.Tensor, params: SamplingParams, prompt: Sequence[int], output: Sequence[int],
                 generator: torch.Generator | None, mask: torch.Tensor | None = None,
                 penalties: Penalties | None = None) -> int:
    """The next token of a request (see the module docstring; ``penalties``: its state)."""
    if mask is None and not needs_processing(params):
        return sample(logits_row, 0.0 if params.greedy else params.temperature, params.top_p, generator)
    return choose(process(logits_row, params, prompt, output, mask, penalties), params, generator)


def token_logprobs(logits_row: torch.Tensor, token: int, k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """(the token's logprob, the ``k`` most likely tokens and theirs), from the raw logits."""
    lp = torch.log_softmax(logits_row.float(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if k:
        values, ids = torch.topk(lp, min(k, lp.numel()))
        top = tuple(zip(ids.tolist(), values.tolist()))
    return float(lp[token]), top


def positions_logprobs(logits: torch.Tensor, next_tokens: Sequence[int], k: int) -> list[Any]:
    """For each row of ``logits`` [T, vocab], the logprob of ``next_tokens[i]`` (the token
    that row predicts) and the top ``k``: ``[(logprob, ((id, lp), ...)), ...]``."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(next_tokens), dtype=torch.long)
    chosen = lp[torch.arange(len(ids)), ids].tolist()
    if not k:
        return [(c, ()) for c in chosen]
    values, top_ids = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
    return [(c, tuple(zip(i, v))) for c, i, v in zip(chosen, top_ids.tolist(), values.tolist())]


def greedy_tokens(plan: Any, outputs: Sequence[torch.Tensor]) -> dict[int, int]:
    """The next token of every request of a step (``plan``: a ``StepPlan``) that samples
    plainly greedy (no grammar, no processor, no logprobs), by ``id``: one argmax over their
    last rows together instead of one a request (the same index: the first of the largest).
    A row with a NaN is left to ``sample_token``, which refuses it."""
    rows = [(item.request, logits[-1]) for item, logits in zip(plan.items, outputs)
            if item.samples and item.request.matcher is None and item.request.params.greedy
            and item.request.params.logprobs is None and not needs_processing(item.request.params)]
    if len(rows) < 2:
        return {}
    last = torch.stack([row for _, row in rows]).float()
    tokens = torch.argmax(last, dim=1)
    # argmax propagates NaN (a row holding one answers a NaN's index), so the chosen
    # values alone tell which rows have one: no second pass over the vocabulary.
    clean = ~torch.isnan(last.gather(1, tokens[:, None])[:, 0])
    return {id(req): int(t) for (req, _), t, ok in zip(rows, tokens.tolist(), clean.tolist()) if ok}
