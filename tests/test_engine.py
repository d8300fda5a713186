"""Engine behaviour on the default model: batching, chunking and paging never change tokens;
pages never leak; bad requests fail before any compute."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv_cache import PageAllocator
from engine.llm import LLM
from engine.sampling_params import InvalidParameter, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each one is prime, step by step, in detail:",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a dragon who",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(page_size=16)


@pytest.fixture(scope="module")
def alone(llm):
    """Each prompt's greedy tokens when it runs by itself."""
    return [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


def assert_no_leaks(llm: LLM) -> None:
    allocator = llm.engine.pages.allocator
    assert not llm.engine.has_unfinished()
    assert allocator.num_free == allocator.num_pages
    assert all(count == 0 for count in allocator.ref_counts)


def test_batched_with_others_equals_alone(llm, alone):
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert all(len(o.token_ids) == 32 for o in outs)
    assert_no_leaks(llm)


def test_mixed_lengths_and_max_tokens_equal_alone(llm, alone):
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 32, 9, 32, 17)]
    outs = llm.generate(PROMPTS, params)
    for out, ref, p in zip(outs, alone, params, strict=True):
        assert out.token_ids == ref[: p.max_tokens]
    assert_no_leaks(llm)


@pytest.mark.parametrize("budget", [7, 16])
def test_chunked_prefill_equals_alone(alone, budget):
    small = LLM(page_size=16, max_num_batched_tokens=budget)
    outs = small.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert_no_leaks(small)


@pytest.mark.parametrize("page_size", [1, 64])
def test_page_sizes_equal_alone(alone, page_size):
    paged = LLM(page_size=page_size)
    outs = paged.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert_no_leaks(paged)


def test_preemption_under_a_tiny_pool_keeps_tokens(alone):
    # 6 pages of 16 tokens: the five requests cannot all hold their KV at once.
    tiny_pool = LLM(page_size=16, kv_cache_memory=6 * 16 * 46080)
    outs = tiny_pool.generate(PROMPTS, GREEDY)
    assert tiny_pool.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == alone
    assert_no_leaks(tiny_pool)


def test_parallel_greedy_samples_share_prompt_and_agree(llm, alone):
    out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, n=3))[0]
    assert [s.token_ids for s in out.samples] == [alone[2]] * 3
    assert_no_leaks(llm)


def test_seeded_sampling_is_independent_of_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    solo = llm.generate([PROMPTS[1]], seeded)[0].token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    mixed = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[3]], [unseeded, seeded, GREEDY])
    assert mixed[1].token_ids == solo
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=24, ignore_eos=True)
    assert llm.generate([PROMPTS[1]], other_seed)[0].token_ids != solo


def test_seeded_parallel_samples_differ_from_each_other(llm):
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=16, ignore_eos=True)
    first = llm.generate([PROMPTS[4]], params)[0]
    again = llm.generate([PROMPTS[4]], params)[0]
    assert [s.token_ids for s in first.samples] == [s.token_ids for s in again.samples]
    assert len({tuple(s.token_ids) for s in first.samples}) > 1


def test_eos_stops_and_max_tokens_reports_length(llm):
    chat = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], add_generation_prompt=True, tokenize=False
    )
    out = llm.generate([chat], SamplingParams(temperature=0.0, max_tokens=200))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.engine.eos_token_ids
    assert len(out.token_ids) < 200
    capped = llm.generate([chat], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert capped.finish_reason == "length" and len(capped.token_ids) == 2


def test_min_tokens_and_stop_token_ids(llm, alone):
    stop_at = alone[0][5]
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=(stop_at,)))[0]
    first = alone[0].index(stop_at)
    assert out.token_ids == alone[0][: first + 1] and out.finish_reason == "stop"


def test_logprobs_are_returned_per_token(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3))[0]
    assert len(out.samples[0].logprobs) == 4
    for token, lp in zip(out.token_ids, out.samples[0].logprobs, strict=True):
        assert lp.token_id == token and lp.logprob <= 0.0
        assert len(lp.top) == 3 and lp.top[0][0] == token  # greedy picks the most likely


@pytest.mark.parametrize(
    "params, match",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(n=0), "n"),
    ],
)
def test_bad_params_fail_before_compute(llm, params, match):
    with pytest.raises(InvalidParameter, match=match):
        llm.generate(["hello"], SamplingParams(**params))
    assert not llm.engine.has_unfinished()


def test_prompt_over_context_fails_before_compute(llm):
    too_long = [42] * llm.engine.max_model_len
    with pytest.raises(InvalidParameter) as err:
        llm.generate([[5, 6], too_long], GREEDY)
    assert err.value.code == "context_length_exceeded"
    assert not llm.engine.has_unfinished()
    with pytest.raises(InvalidParameter, match="empty"):
        llm.generate([[]], GREEDY)


def test_abort_frees_pages_at_once(llm):
    engine = llm.engine
    engine.add_request("to-abort", llm.tokenizer.encode(PROMPTS[2]), SamplingParams(max_tokens=100, n=2))
    engine.step()
    engine.step()
    engine.abort("to-abort")
    outputs = engine.step()
    assert {(o.index, o.finish_reason) for o in outputs} == {(0, "abort"), (1, "abort")}
    assert_no_leaks(llm)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "share", "release"]), st.integers(0, 6)), max_size=40))
def test_allocator_matches_reference_counts(ops):
    allocator = PageAllocator(8)
    held: list[int] = []  # one entry per reference we hold
    for op, n in ops:
        if op == "alloc" and n <= allocator.num_free:
            held += allocator.allocate(n)
        elif op == "share" and held:
            page = held[n % len(held)]
            allocator.share([page])
            held.append(page)
        elif op == "release" and held:
            allocator.release([held.pop(n % len(held))])
        assert allocator.num_free == 8 - len(set(held))
        assert all(allocator.ref_counts[p] == held.count(p) for p in range(8))
    allocator.release(held)
    assert allocator.num_free == 8
    with pytest.raises(AssertionError, match="double free"):
        allocator.release([0])
