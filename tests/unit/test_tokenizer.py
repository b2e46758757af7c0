"""ByteTokenizer: lossless round trip, specials, chat template, input validation."""

from __future__ import annotations

import pytest

from cluster.engine.tokenizer import ByteTokenizer, Tokenizer

tok = ByteTokenizer()


def test_ids_and_protocol() -> None:
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)


@pytest.mark.parametrize(
    "text", ["", "hello", "naïve café", "日本語 テキスト", "emoji 🙂\n\ttab", "\x00nul"]
)
def test_round_trip(text: str) -> None:
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_encode_is_bytes() -> None:
    assert tok.encode("aé") == [97, 0xC3, 0xA9]


def test_decode_drops_specials_and_replaces_invalid_utf8() -> None:
    assert tok.decode([256, 104, 105, 257, 258]) == "hi"
    assert tok.decode([104, 0xC3]) == "h\ufffd"  # truncated two-byte sequence
    assert tok.decode([0xFF, 105]) == "\ufffdi"
    assert tok.decode(()) == ""


def test_chat_template_exact_and_deterministic() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi é"}]
    ids = tok.apply_chat_template(messages)
    assert ids[0] == tok.bos_id
    assert ids[1:] == tok.encode("<|system|>\nBe brief.\n<|user|>\nHi é\n<|assistant|>\n")
    assert tok.apply_chat_template([dict(m) for m in messages]) == ids


def test_chat_template_is_append_only_across_turns() -> None:
    # Prompt of turn 1 + the reply is a prefix of the prompt of turn 2: multi-turn chats hit the cache.
    turn1 = [{"role": "user", "content": "What is 2+2?"}]
    prompt1 = tok.apply_chat_template(turn1)
    reply = "4"
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And 3+3?"}]
    prompt2 = tok.apply_chat_template(turn2)
    prefix = prompt1 + tok.encode(reply)
    assert prompt2[: len(prefix)] == prefix
    assert len(prompt2) > len(prefix)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: tok.encode(b"bytes"), TypeError, "text must be a str"),
        (lambda: tok.encode(None), TypeError, "text must be a str"),
        (lambda: tok.decode("abc"), TypeError, "ids must be a sequence of ints"),
        (lambda: tok.decode(5), TypeError, "ids must be a sequence of ints"),
        (lambda: tok.decode([1, 2.0]), TypeError, r"ids\[1\] must be an int"),
        (lambda: tok.decode([True]), TypeError, r"ids\[0\] must be an int"),
        (lambda: tok.decode([259]), ValueError, r"ids\[0\] = 259 is outside \[0, 259\)"),
        (lambda: tok.decode([-1]), ValueError, "outside"),
        (lambda: tok.apply_chat_template("hi"), TypeError, "messages must be a list"),
        (lambda: tok.apply_chat_template([]), ValueError, "messages must not be empty"),
        (lambda: tok.apply_chat_template(["hi"]), TypeError, r"messages\[0\] must be a dict"),
        (lambda: tok.apply_chat_template([{"content": "x"}]), ValueError, r"messages\[0\]\['role'\]"),
        (lambda: tok.apply_chat_template([{"role": "User|", "content": "x"}]), ValueError, "role"),
        (lambda: tok.apply_chat_template([{"role": "user", "content": 3}]), TypeError,
         r"messages\[0\]\['content'\] must be a str"),
    ],
)
def test_bad_input_raises_clear_errors(call, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        call()


def test_stop_token_ids_are_eos() -> None:
    assert tok.stop_token_ids == (tok.eos_id,) == (257,)
