"""Incremental detokenization and stop strings, on the default model's real tokenizer."""

from __future__ import annotations

import functools

import pytest

from engine.model_files import resolve_model_dir
from engine.outputs import RequestOutput, TokenLogprob
from frontend.detokenizer import Detokenizer, IncrementalDecoder, StopMatcher
from frontend.tokens import TokenPieces, load_tokenizer, make_decode
from ipc.messages import DetokSetup, TokenBatch

MIXED = "Hi 😀 — 世界你好, naïve café 🇯🇵👍🏽! Ünïcödé ✓ done."


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_dir(None))


def decoder(tokenizer, context=()) -> IncrementalDecoder:
    return IncrementalDecoder(functools.partial(tokenizer.decode, skip_special_tokens=True), list(context))


def test_fixture_text_really_splits_characters(tokenizer):
    """Guard: the test below only means something if some tokens hold partial characters."""
    ids = tokenizer.encode(MIXED)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)


def test_one_token_at_a_time_never_breaks_a_character(tokenizer):
    ids = tokenizer.encode(MIXED)
    dec = decoder(tokenizer)
    deltas = [dec.push([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + dec.flush() == MIXED
    assert "" in deltas  # some tokens had to wait for the rest of their character


@pytest.mark.parametrize("chunk", [2, 3, 5])
def test_chunks_of_tokens(tokenizer, chunk):
    ids = tokenizer.encode(MIXED)
    dec = decoder(tokenizer)
    text = "".join(dec.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk))
    assert "\ufffd" not in text
    assert text + dec.flush() == MIXED


def test_prompt_context_keeps_leading_space(tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    out = tokenizer.encode(" Paris, 東京")
    dec = decoder(tokenizer, prompt[-5:])
    assert "".join(dec.push([t]) for t in out) + dec.flush() == " Paris, 東京"


def test_flush_releases_an_unfinished_character(tokenizer):
    ids = tokenizer.encode("ok 😀")
    dec = decoder(tokenizer)
    text = "".join(dec.push([t]) for t in ids[:-1])
    assert text == "ok"
    assert "\ufffd" in dec.flush()  # the model really did stop mid-character


# ---------------------------------------------------------------- stop strings


def feed_all(matcher: StopMatcher, chunks: list[str]) -> tuple[str, bool]:
    out = []
    for chunk in chunks:
        text, stopped = matcher.feed(chunk)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


@pytest.mark.parametrize(
    "chunks,stops,expected",
    [
        (["Hello wor", "ld STO", "P more"], ("STOP",), ("Hello world ", True)),
        (["a", "b", "c", "S", "T", "O", "P", "x"], ("STOP",), ("abc", True)),
        (["line one\n", "\nline two"], ("\n\n",), ("line one", True)),
        (["ST", "ART", "STOP"], ("STOP",), ("START", True)),
        (["no stop here S", "T"], ("STOP",), ("no stop here ST", False)),
        (["xx END yy STOP"], ("STOP", "END"), ("xx ", True)),  # the earliest one wins
        (["aab"], ("ab",), ("a", True)),
        (["a", "a", "b"], ("ab",), ("a", True)),
        (["😀 ok", "世界"], ("世",), ("😀 ok", True)),
        (["plain"], (), ("plain", False)),
    ],
)
def test_stop_strings(chunks, stops, expected):
    assert feed_all(StopMatcher(stops), chunks) == expected


def test_only_possible_stop_prefixes_are_held():
    m = StopMatcher(("STOP",))
    assert m.feed("abc S") == ("abc ", False)
    assert m.feed("x") == ("Sx", False)
    assert m.feed("ST") == ("", False)
    assert m.feed("OX") == ("STOX", False)


# ---------------------------------------------------------------- the whole detokenizer


def out(rid, ids, index=0, finish=None, n_out=1, logprobs=None):
    return RequestOutput(rid=rid, index=index, new_token_ids=ids, finished=finish is not None,
                         finish_reason=finish, num_prompt_tokens=3, num_output_tokens=n_out, logprobs=logprobs)


def run(detok, rid, ids, setup, index=0, finish_last="length"):
    """Feed ids one per batch; return (joined text, deltas, rids to stop)."""
    deltas, stops = [], []
    for i, t in enumerate(ids):
        finish = finish_last if i == len(ids) - 1 else None
        batch = TokenBatch([out(rid, [t], index, finish, i + 1)], [setup] if i == 0 else [])
        d, s = detok.process(batch)
        deltas += d
        stops += s
        if s:
            break
    return "".join(d.text for d in deltas), deltas, stops


def test_stop_string_across_tokens_cuts_and_asks_scheduler_to_stop(tokenizer):
    detok = Detokenizer(tokenizer)
    ids = tokenizer.encode("The answer is 42. Then more text follows here.")
    text, deltas, stops = run(detok, "r", ids, DetokSetup(rid="r", stop=("42.",)))
    assert text == "The answer is "
    assert stops == ["r"]
    assert deltas[-1].finish_reason == "stop"
    assert deltas[-1].usage.completion_tokens < len(ids)
    assert "r" not in detok.requests
    # Late outputs (the scheduler's abort) for the finished request are dropped quietly.
    assert detok.process(TokenBatch([out("r", [], finish="abort")])) == ([], [])


def test_engine_finish_flushes_held_text(tokenizer):
    detok = Detokenizer(tokenizer)
    ids = tokenizer.encode("ends with ST")
    text, deltas, stops = run(detok, "r", ids, DetokSetup(rid="r", stop=("STOP",)))
    assert text == "ends with ST"
    assert stops == []
    assert deltas[-1].finish_reason == "length"


def test_eos_token_is_not_text(tokenizer):
    detok = Detokenizer(tokenizer)
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Bye.") + [eos]
    text, deltas, _ = run(detok, "r", ids, DetokSetup(rid="r", skip_special_tokens=False), finish_last="stop")
    assert text == "Bye."
    assert deltas[-1].finish_reason == "stop"
    assert deltas[-1].usage.completion_tokens == len(ids)


@pytest.mark.parametrize("engine_finishes_sample_0", [True, False])
def test_n_samples_finish_scheduler_only_when_all_are_done(tokenizer, engine_finishes_sample_0):
    detok = Detokenizer(tokenizer)
    setup = DetokSetup(rid="r", n=2, stop=("X",), tokenizer_worker=1)
    a, b = tokenizer.encode("aXq"), tokenizer.encode(" bee cee dee")
    assert len(a) >= 2 and len(b) >= 3
    deltas, stops = detok.process(TokenBatch([out("r", [a[0]], 0), out("r", [b[0]], 1)], [setup]))
    deltas, stops = detok.process(TokenBatch([out("r", [a[1]], 0, n_out=2), out("r", [b[1]], 1, n_out=2)]))
    assert stops == []  # sample 1 still wants tokens
    assert [d.finish_reason for d in deltas if d.index == 0] == ["stop"]
    assert deltas[0].tokenizer_worker == 1
    finish_0 = "length" if engine_finishes_sample_0 else None
    batch = TokenBatch([out("r", [a[2]], 0, finish_0, 3), out("r", [b[2]], 1, "length", 3)])
    deltas, stops = detok.process(batch)
    assert [d.index for d in deltas] == [1]  # sample 0's late tokens are dropped
    # Only a sample the engine is still computing needs the scheduler told.
    assert stops == ([] if engine_finishes_sample_0 else ["r"])
    assert detok.requests == {}


def test_echo_and_logprobs(tokenizer):
    detok = Detokenizer(tokenizer)
    smile = tokenizer.encode(" 😀")
    lps = [TokenLogprob(t, -0.5, [(t, -0.5), (smile[0], -1.5)]) for t in smile]
    setup = DetokSetup(rid="r", echo_text="Say:", logprobs=True)
    deltas, _ = detok.process(TokenBatch([out("r", smile, finish="length", n_out=len(smile), logprobs=lps)], [setup]))
    assert deltas[0].text == "Say: 😀"
    got = deltas[0].logprobs
    assert b"".join(lp.token_bytes for lp in got) == " 😀".encode()
    assert got[0].top[1].token_bytes == got[0].token_bytes


def test_token_pieces_bytes(tokenizer):
    pieces = TokenPieces(tokenizer)
    for text in ["hello", " 世界", "😀"]:
        ids = tokenizer.encode(text)
        assert b"".join(pieces.get(t)[1] for t in ids) == text.encode()
    assert pieces.get(tokenizer.eos_token_id)[0] == tokenizer.eos_token


@pytest.mark.parametrize("skip", [True, False])
def test_fast_decode_matches_transformers(tokenizer, skip):
    ids = [tokenizer.eos_token_id, *tokenizer.encode(MIXED), tokenizer.eos_token_id]
    decode = make_decode(tokenizer, skip)
    for i in range(len(ids)):
        assert decode(ids[i : i + 4]) == tokenizer.decode(ids[i : i + 4], skip_special_tokens=skip)
