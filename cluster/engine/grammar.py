"""Structured output: a grammar a request's tokens must follow, enforced by a token mask.

The library is llguidance (Microsoft's guidance, in Rust; vLLM ships it as one of
its structured-output backends): JSON schema, regex, a fixed set of choices and
Lark grammars compile to one kind of matcher, whose next-token mask costs tens
of microseconds and never depends on other requests. It was chosen over
xgrammar (vLLM's default; as maintained, and as fast at this scale) because it
installs with no other package: xgrammar brings triton and a TVM runtime, which a
CPU deployment would carry for nothing.

A ``GrammarSpec`` is what crosses the wire (inside ``SamplingParams``); each
replica compiles it against its tokenizer (``Grammars.matcher``) when the request
is submitted, and the engine asks the matcher for the mask of every token it
samples (``Grammars.mask``) and feeds it every token sampled. Only constrained
requests pay for masks; the others sample as before.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from cluster.errors import InvalidInputError

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
MAX_SOURCE_CHARS = 64 << 10
# JSON as json.dumps writes it: no free whitespace (a model cannot pad a value with
# newlines until max_tokens), the separators a model most likely writes anyway.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_available() -> bool:
    try:
        import llguidance  # noqa: F401
    except Exception:
        return False
    return True


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One constraint: ``kind`` one of ``KINDS``; ``source`` the JSON schema (text),
    the regex, the Lark grammar, or the choices as a JSON list of strings."""
    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidInputError(f"grammar kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.source, str) or len(self.source) > MAX_SOURCE_CHARS:
            raise InvalidInputError(f"grammar source must be a string of at most {MAX_SOURCE_CHARS} characters")

    def grammar(self) -> str:
        """The llguidance grammar of this constraint (not yet checked)."""
        from llguidance import LLMatcher

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            choices = json.loads(self.source)
            return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in choices))
        return LLMatcher.grammar_from_lark(self.source)

    def check(self) -> None:
        """Raise ``InvalidInputError`` naming the problem when this does not compile."""
        if not grammar_available():
            raise InvalidInputError("structured output needs llguidance (pip install llguidance)")
        from llguidance import LLMatcher

        try:
            error = LLMatcher.validate_grammar(self.grammar())
        except (ValueError, TypeError) as exc:
            error = str(exc)
        if error and not error.startswith("WARNING"):
            raise InvalidInputError(f"the {self.kind.replace('_', ' ')} does not compile: {error.strip()[:500]}")


def choice_spec(choices: Sequence[str]) -> GrammarSpec:
    return GrammarSpec("choice", json.dumps(list(choices)))


def _ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's tokenizer for ``tokenizer`` (an ``HFTokenizer`` or the byte tokenizer)."""
    import llguidance
    import llguidance.hf

    hf = getattr(tokenizer, "tokenizer", None)
    if hf is not None:
        return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=list(tokenizer.stop_token_ids))
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocab(tokenizer)), n_vocab=vocab_size)


def ll_tokenizer_from_files(directory: Path, vocab_size: int) -> Any | None:
    """llguidance's tokenizer straight from a checkpoint's ``tokenizer.json``, in Rust: the
    JSON ``llguidance.hf.from_tokenizer`` would hand it (padding and truncation off), with
    the stop tokens ``HFTokenizer`` gives (EOS, then the generation config's). About 0.4 s,
    where loading the tokenizer through transformers first took about 2 s holding the GIL
    (docs/engine.md). None where the files alone do not say the whole tokenizer (an added
    token only in ``tokenizer_config.json``, an EOS named two ways or not at all): then the
    caller loads it through transformers as before."""
    from cluster.engine.hf_adapter import generation_eos_ids

    def read(name: str) -> dict:
        path = directory / name
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}

    def content(token: Any) -> Any:
        return token.get("content") if isinstance(token, dict) else token

    path = directory / "tokenizer.json"
    text = path.read_text(encoding="utf-8") if path.is_file() else "{}"
    spec = json.loads(text)
    config, special = read("tokenizer_config.json"), read("special_tokens_map.json")
    vocab = (spec.get("model") or {}).get("vocab")
    if not isinstance(vocab, dict):
        return None
    added = {t.get("content"): t.get("id") for t in spec.get("added_tokens") or ()}
    for token_id, token in (config.get("added_tokens_decoder") or {}).items():
        if added.get(content(token)) != int(token_id):
            return None
    names = {content(config.get("eos_token")), content(special.get("eos_token"))} - {None}
    if len(names) != 1:
        return None
    (eos,) = names
    eos_id = added.get(eos, vocab.get(eos))
    if not isinstance(eos_id, int):
        return None
    stops = [eos_id]
    stops += [t for t in generation_eos_ids(directory / "generation_config.json") if t not in stops]
    if any(not 0 <= t < vocab_size for t in stops):
        return None
    if spec.get("padding") is not None or spec.get("truncation") is not None:
        spec["padding"] = spec["truncation"] = None
        text = json.dumps(spec)
    import llguidance

    return llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=stops)


class _ByteVocab:
    """The built-in byte tokenizer as llguidance sees a tokenizer."""

    def __init__(self, tokenizer: Any):
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [bytes([i]) for i in range(256)] + [b"<bos>", b"<eos>", b"<pad>"]
        self.special_token_ids = [256, 257, 258]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


class Grammars:
    """The grammars of one tokenizer: compiles specs into matchers, computes masks.

    llguidance's view of the tokenizer (a pass over the whole vocabulary: seconds for a
    49k-token vocabulary on a busy CPU) is built once, by ``prepare`` or on the first
    ``matcher`` that needs it, whichever comes first (``deferred``: also the tokenizer's
    own load). A replica prepares it on a thread once its engine has idled a while
    (``actors.core.GRAMMARS_AFTER_IDLE_S``: the build holds the GIL, so steps beside it
    run slower), so neither its start nor its first requests wait for it; a constrained
    request that comes first builds it itself, and one that comes during a build waits
    for that build (one at a time)."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.vocab_size = vocab_size
        self._load: Callable[[], Any] = lambda: tokenizer
        self._files: Path | None = None   # a checkpoint whose tokenizer.json is tried first
        self._ll: Any = None
        self._lock = threading.Lock()
        self.build_s: float | None = None   # seconds the build took (None: not built yet)

    @classmethod
    def deferred(cls, load: Callable[[], Any], vocab_size: int, checkpoint_dir: Path | None = None) -> "Grammars":
        """Grammars whose tokenizer ``load()`` returns, loaded when they are first prepared;
        with ``checkpoint_dir``, built from its ``tokenizer.json`` without loading it where
        the files say the whole tokenizer (``ll_tokenizer_from_files``)."""
        out = cls(None, vocab_size)
        out._load = load
        out._files = checkpoint_dir
        return out

    @property
    def ready(self) -> bool:
        return self._ll is not None

    def prepare(self) -> None:
        """Build llguidance's tokenizer now (any thread; once: later calls return at once)."""
        self._tokenizer()

    def _tokenizer(self) -> Any:
        if self._ll is not None:
            return self._ll
        # One build at a time; a caller that comes during one waits for it. Two at once (two
        # constrained requests, or one beside the replica's background build) load the
        # tokenizer through transformers' lazy modules from two threads, which failed with
        # "module 'transformers' has no attribute 'AutoTokenizer'" (a 503).
        with self._lock:
            if self._ll is None:
                began = time.perf_counter()
                direct = None if self._files is None else ll_tokenizer_from_files(self._files, self.vocab_size)
                self._ll = direct if direct is not None else _ll_tokenizer(self._load(), self.vocab_size)
                self.build_s = round(time.perf_counter() - began, 3)
        return self._ll

    def matcher(self, spec: GrammarSpec, consumed: Sequence[int] = ()) -> Any:
        """A fresh matcher for ``spec``, advanced over ``consumed`` (a resumed request's
        tokens so far); ``InvalidInputError`` when it does not compile or the tokens
        do not follow it."""
        from llguidance import LLMatcher

        spec.check()
        m = LLMatcher(self._tokenizer(), spec.grammar(), log_level=0)
        if m.is_error():
            raise InvalidInputError(f"the {spec.kind} does not compile: {m.get_error()[:500]}")
        if consumed and not m.consume_tokens(list(consumed)):
            raise InvalidInputError("the tokens generated before the resume do not follow the grammar")
        return m

    def mask(self, matcher: Any) -> torch.Tensor:
        """The tokens ``matcher`` allows next, as a bool tensor over the model's vocabulary."""
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)
        out = torch.zeros(self.vocab_size, dtype=torch.bool)
        out[:allowed.shape[0]] = torch.from_numpy(allowed)
        return out
