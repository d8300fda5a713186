"""End-to-end tests of the OpenAI API against one live server (the `api_server` fixture).

The server runs the real engine on the default model with two tokenizer workers and an API
key; the official `openai` client drives it. Generations stay short: CI has two cores.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import openai
import pytest

from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Name three colors."}]
EMOJI_CHAT = [{"role": "user", "content": "Give me three emojis that describe happiness."}]


@pytest.fixture(scope="module")
def client(api_server):
    return api_server.client()


def collect_stream(chunks, chat: bool) -> tuple[dict[int, str], dict[int, str], object]:
    """Rebuild each choice's text and finish reason from stream chunks, plus the usage."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.usage or usage
        for c in chunk.choices:
            piece = (c.delta.content if chat else c.text) or ""
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, finish, usage


# ---------------------------------------------------------------- basics


def test_health_ready_models(api_server, client):
    # No key needed: health checks stay open.
    assert api_server.request("GET", "/health", auth=False) == (200, {"status": "ok"})
    assert api_server.request("GET", "/ready", auth=False)[0] == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat(client):
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    assert resp.model == MODEL and abs(resp.created - time.time()) < 120
    (choice,) = resp.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    u = resp.usage
    assert u.prompt_tokens > 5 and 1 <= u.completion_tokens <= 8
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_chat_stream_equals_non_stream(client):
    args = dict(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    texts, finish, usage = collect_stream(chunks, chat=True)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert texts == {0: whole.choices[0].message.content}
    assert finish == {0: whole.choices[0].finish_reason}
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.id == chunks[0].id for c in chunks)


def test_stream_without_usage_has_no_usage_chunk(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_completions_stream_and_not(client):
    args = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    whole = client.completions.create(**args)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    texts, finish, usage = collect_stream(chunks, chat=False)
    assert texts == {0: whole.choices[0].text}
    assert finish == {0: whole.choices[0].finish_reason}
    assert usage.total_tokens == whole.usage.total_tokens


def test_completion_prompt_shapes_and_echo(client):
    prompt = "One, two, three,"
    ids = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=0)
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert text.choices[0].text.startswith(prompt)
    many = client.completions.create(model=MODEL, prompt=[prompt, "A, B, C,"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == text.choices[0].text[len(prompt):][: len(many.choices[0].text)]
    # The same prompt as token ids gives the same greedy text.
    token_ids = _tokenize(prompt)
    by_ids = client.completions.create(model=MODEL, prompt=token_ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == text.choices[0].text[len(prompt):]
    assert ids.usage.prompt_tokens == len(token_ids)


def _tokenize(text: str) -> list[int]:
    from engine.model_files import resolve_model_dir
    from frontend.tokens import load_tokenizer

    return load_tokenizer(resolve_model_dir(None)).encode(text)


# ---------------------------------------------------------------- sampling


def test_n_choices(client):
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=3, seed=7, temperature=1.0)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in resp.choices)
    assert len({c.message.content for c in resp.choices}) > 1  # three samples, not one thrice
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=3, seed=7,
                                                 temperature=1.0, stream=True, stream_options={"include_usage": True}))
    texts, finish, usage = collect_stream(chunks, chat=True)
    assert texts == {c.index: c.message.content for c in resp.choices}  # same seed, same samples
    assert usage.completion_tokens == resp.usage.completion_tokens


def test_seeded_sampling_repeats_exactly(client):
    args = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=1.0, top_p=0.95, seed=1234)
    first = client.chat.completions.create(**args).choices[0].message.content
    # Again, now batched with other requests: a seed fixes the tokens whatever shares the batch.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(client.chat.completions.create, **{**args, "seed": s}) for s in (1, 2)]
        again = [pool.submit(client.chat.completions.create, **args) for _ in range(2)]
        assert [f.result().choices[0].message.content for f in again] == [first, first]
        other_texts = {f.result().choices[0].message.content for f in others}
    assert other_texts != {first}


def test_greedy_matches_offline_engine(client):
    """The server's text equals the in-process engine's for the same prompts and params."""
    from engine.llm import LLM

    llm = LLM()
    try:
        prompt = "The three primary colors are"
        offline = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0))[0].text
        served = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        assert served.choices[0].text == offline
        chat_text = llm.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        chat_ids = llm.tokenizer.encode(chat_text, add_special_tokens=False)
        offline = llm.generate([chat_ids], SamplingParams(max_tokens=16, temperature=0))[0]
        served = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
        assert served.choices[0].message.content == offline.text
        assert served.usage.completion_tokens == len(offline.token_ids)
    finally:
        del llm


def test_stop_string_across_token_boundary(client):
    base = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                                     logprobs=0, extra_body={"ignore_eos": True})
    full, tokens = base.choices[0].text, base.choices[0].logprobs.tokens
    # A stop string made of the end of one token and the start of the next.
    i = next(i for i in range(3, len(tokens) - 1) if len(tokens[i].strip()) >= 2 and len(tokens[i + 1].strip()) >= 2)
    stop = tokens[i][-2:] + tokens[i + 1][:2]
    expected = full[: full.index(stop)]
    cut = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                                    stop=[stop, "never-matches"], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == expected
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 24  # the engine stopped early, not just the text
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                                            stop=stop, extra_body={"ignore_eos": True}, stream=True))
    texts, finish, _ = collect_stream(chunks, chat=False)
    assert texts == {0: expected} and finish == {0: "stop"}


def test_logprobs(client):
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 6
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)  # greedy: the best one
    assert bytes(b for t in content for b in t.bytes).decode() == resp.choices[0].message.content
    comp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, logprobs=1, temperature=0)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == comp.choices[0].text


def test_emoji_and_cjk_stream_intact(client):
    args = dict(model=MODEL, messages=EMOJI_CHAT, max_tokens=24, temperature=0, logprobs=True)
    whole = client.chat.completions.create(**args)
    text = whole.choices[0].message.content
    assert any(ord(ch) > 0xFFFF for ch in text), text  # the answer really has emoji
    # ...made of tokens that each hold only part of a character.
    assert any(_partial_utf8(bytes(t.bytes)) for t in whole.choices[0].logprobs.content)
    assert "\ufffd" not in text
    chunks = list(client.chat.completions.create(**args, stream=True))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    # CJK too: full-width punctuation that this prompt produces, through completions.
    cjk = dict(model=MODEL, prompt="你好你好你好", max_tokens=6, temperature=0)
    text = client.completions.create(**cjk).choices[0].text
    assert text and all(ord(ch) > 0x2000 for ch in text.strip()) and "\ufffd" not in text
    streamed, _, _ = collect_stream(list(client.completions.create(**cjk, stream=True)), chat=False)
    assert streamed == {0: text}


def _partial_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


# ---------------------------------------------------------------- errors


def _error(exc_info) -> dict:
    return exc_info.value.body if isinstance(exc_info.value.body, dict) else {}


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (dict(messages=[]), "messages"),
        (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
        (dict(messages=CHAT, max_tokens=0), "max_tokens"),
        (dict(messages=CHAT, temperature=-0.5), "temperature"),
        (dict(messages=CHAT, top_p=2), "top_p"),
        (dict(messages=CHAT, n=0), "n"),
        (dict(messages=CHAT, extra_body={"max_tokens": "many"}), "max_tokens"),
        (dict(messages=CHAT, extra_body={"top_k": -5}), "top_k"),
        (dict(messages=CHAT, presence_penalty=5), "presence_penalty"),
        (dict(messages=CHAT, top_logprobs=50, logprobs=True), "logprobs"),
    ],
)
def test_bad_chat_requests_are_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, **kwargs)
    body = _error(err)
    assert body["type"] == "invalid_request_error" and body["param"] == param and body["message"]


@pytest.mark.parametrize("prompt", ["", [], [[]], [10**9]])
def test_bad_completion_prompts_are_400(client, prompt):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert _error(err)["param"] == "prompt"


@pytest.mark.parametrize("stream", [False, True])
def test_context_length_exceeded(client, stream):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=9000, stream=stream)
    assert _error(err)["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="word " * 8300, max_tokens=1, stream=stream)
    body = _error(err)
    assert body["code"] == "context_length_exceeded" and body["param"] == "prompt"
    assert "8192" in body["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-9", messages=CHAT, max_tokens=2)
    assert _error(err)["code"] == "model_not_found"


def test_bad_api_key_is_401(api_server):
    bad = openai.OpenAI(base_url=api_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.models.list()
    assert _error(err)["code"] == "invalid_api_key"
    status, body = api_server.request("POST", "/v1/chat/completions", {"messages": CHAT}, auth=False)
    assert status == 401 and body["error"]["type"] == "invalid_request_error"


def test_raw_http_errors(api_server):
    status, body = api_server.request("POST", "/v1/chat/completions", b'{"messages": [')
    assert status == 400 and "Malformed JSON" in body["error"]["message"]
    big = json.dumps({"model": MODEL, "prompt": "x" * (2 * 2**20)}).encode()  # the server allows 1 MiB
    status, body = api_server.request("POST", "/v1/completions", big)
    assert status == 413 and body["error"]["message"]
    status, body = api_server.request("GET", "/v1/nope")
    assert status == 404 and "error" in body
    status, body = api_server.request("GET", "/v1/chat/completions")
    assert status == 405 and "error" in body


def test_bad_requests_never_reach_the_scheduler(api_server, client):
    def received() -> int:
        return api_server.server_info()["engine"]["requests_received"]

    before = received()
    bad_calls = [
        lambda: client.chat.completions.create(model=MODEL, messages=[]),
        lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "x", "content": "y"}]),
        lambda: client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=9000),
        lambda: client.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1),
        lambda: client.chat.completions.create(model="nope", messages=CHAT),
        lambda: client.completions.create(model=MODEL, prompt=[49152]),
        lambda: client.completions.create(model=MODEL, prompt="word " * 8300, max_tokens=1),
    ]
    for call in bad_calls:
        with pytest.raises(openai.APIStatusError):
            call()
    assert api_server.request("POST", "/v1/completions", b"{oops")[0] == 400
    assert received() == before
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert received() == before + 1


def test_server_healthy_and_idle_after_errors(api_server, client):
    resp = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert resp.choices[0].text is not None
    engine = _wait_idle(api_server)
    assert engine["num_free_pages"] == engine["num_total_pages"]


# ---------------------------------------------------------------- process layout


def test_requests_spread_over_both_workers(api_server, client):
    before = api_server.server_info()["tokenizer_workers"]
    for _ in range(4):
        client.completions.create(model=MODEL, prompt="Count: 1, 2,", max_tokens=1)
    after = api_server.server_info()["tokenizer_workers"]
    assert set(after) == {"0", "1"}
    assert all(after[w] > before[w] for w in after), (before, after)


def test_client_disconnect_aborts_and_frees_pages(api_server):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    conn = api_server.connect()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                 headers={"Authorization": f"Bearer {api_server.api_key}"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = [resp.fp.readline() for _ in range(8)]  # a few tokens are out: the request is running
    assert sum(b'"content"' in e for e in events) >= 3
    assert api_server.server_info()["engine"]["num_running"] == 1
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
    conn.close()
    left = time.monotonic()
    engine = _wait_idle(api_server, timeout=10)
    took = time.monotonic() - left
    assert engine["num_free_pages"] == engine["num_total_pages"]
    assert took < 5, f"abort took {took:.1f} s; 4000 tokens would take minutes"
    # ...and the server carries on.
    assert api_server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices


def test_client_leaving_a_non_streamed_request_aborts_it(api_server):
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 4000, "ignore_eos": True}
    conn = api_server.connect()
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Authorization": f"Bearer {api_server.api_key}"})
    deadline = time.monotonic() + 60
    while api_server.server_info()["engine"]["num_running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    engine = _wait_idle(api_server, timeout=10)
    assert engine["num_running"] == 0 and engine["num_free_pages"] == engine["num_total_pages"]


def _wait_idle(server, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        engine = server.server_info()["engine"]
        idle = engine["num_running"] == 0 and engine["num_waiting"] == 0
        if (idle and engine["num_free_pages"] == engine["num_total_pages"]) or time.monotonic() > deadline:
            return engine
        time.sleep(0.05)
