"""Request parsing and validation, without a server: every bad input names its parameter."""

from __future__ import annotations

import json

import pytest

from frontend.protocol import ApiError, ModelNames, parse_chat, parse_completion

MODELS = ModelNames(["smol"])
CHAT = {"model": "smol", "messages": [{"role": "user", "content": "hi"}]}


def chat(**fields):
    return parse_chat(json.dumps({**CHAT, **fields}).encode(), MODELS)


def completion(**fields):
    return parse_completion(json.dumps({"model": "smol", "prompt": "hi", **fields}).encode(), MODELS)


def error_of(fn, *args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as err:
        fn(*args, **kwargs)
    return err.value


def test_chat_defaults():
    plan = chat()
    assert plan.kind == "chat" and plan.model == "smol" and plan.n == 1 and not plan.stream
    (req,) = plan.prompts
    assert req.max_tokens is None  # the rest of the context, filled in by the worker
    assert req.messages[0].role == "user" and req.messages[0].content == "hi"
    assert req.params.temperature == 1.0 and req.params.logprobs is None


def test_chat_fields_and_extensions():
    plan = chat(max_tokens=9, max_completion_tokens=7, n=2, stop="END", temperature=0, top_p=0.5, seed=4,
                presence_penalty=0.5, frequency_penalty=-0.5, logprobs=True, top_logprobs=3, user="u",
                stream=True, stream_options={"include_usage": True}, top_k=5, min_p=0.1,
                repetition_penalty=1.2, ignore_eos=True, min_tokens=2, stop_token_ids=[7], priority=-1)
    (req,) = plan.prompts
    p = req.params
    assert req.max_tokens == 7 and p.max_tokens == 7  # max_completion_tokens wins
    assert (p.n, p.stop, p.temperature, p.top_p, p.seed) == (2, ("END",), 0.0, 0.5, 4)
    assert (p.presence_penalty, p.frequency_penalty, p.logprobs) == (0.5, -0.5, 3)
    assert (p.top_k, p.min_p, p.repetition_penalty, p.ignore_eos, p.min_tokens) == (5, 0.1, 1.2, True, 2)
    assert p.stop_token_ids == (7,) and req.priority == -1
    assert plan.stream and plan.include_usage and plan.logprobs


def test_nulls_mean_defaults():
    plan = chat(temperature=None, n=None, stop=None, max_tokens=None, model=None)
    assert plan.prompts[0].params.temperature == 1.0 and plan.n == 1


def test_content_parts_are_joined():
    plan = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert plan.prompts[0].messages[0].content == "ab"


@pytest.mark.parametrize(
    "prompt,expected",
    [
        ("hello", [("hello", None)]),
        (["a", "b"], [("a", None), ("b", None)]),
        ([1, 2, 3], [(None, [1, 2, 3])]),
        ([[1, 2], [3]], [(None, [1, 2]), (None, [3])]),
    ],
)
def test_completion_prompt_shapes(prompt, expected):
    plan = completion(prompt=prompt, echo=True, logprobs=2)
    assert [(r.prompt, r.prompt_token_ids) for r in plan.prompts] == expected
    assert plan.prompts[0].max_tokens == 16  # OpenAI's default for completions
    assert plan.echo and plan.logprobs and plan.prompts[0].params.logprobs == 2


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"content": "x"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 1000}, "n"),
        ({"n": 1.5}, "n"),
        ({"stop": 5}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "logprobs"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": "x"}, "seed"),
        ({"priority": 1.5}, "priority"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_chat_errors_name_the_param(body, param):
    err = error_of(chat, **body)
    assert err.status == 400
    assert err.param == param
    assert err.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "prompt",
    ["", [], [""], [[]], [1, "a"], [-1, 2], [[1], "a"], [True], {"x": 1}, None, 5],
)
def test_bad_completion_prompts(prompt):
    err = error_of(completion, prompt=prompt)
    assert (err.status, err.param) == (400, "prompt")


def test_completion_logprobs_range():
    assert error_of(completion, logprobs=21).param == "logprobs"


def test_missing_prompt_and_messages():
    assert error_of(parse_completion, b'{"model": "smol"}', MODELS).param == "prompt"
    assert error_of(parse_chat, b"{}", MODELS).param == "messages"


@pytest.mark.parametrize("body", [b"", b"{", b"not json", b'{"messages": [}'])
def test_malformed_json(body):
    err = error_of(parse_chat, body, MODELS)
    assert err.status == 400 and "Malformed JSON" in err.message


def test_body_must_be_an_object():
    assert error_of(parse_chat, b"[1, 2]", MODELS).status == 400


def test_unknown_model_is_404():
    err = error_of(chat, model="gpt-4")
    assert (err.status, err.param, err.code) == (404, "model", "model_not_found")
