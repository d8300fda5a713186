"""Our model implementations against transformers: logits of one pass, and greedy tokens."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import ARCHS, build_tiny_model, hf_greedy

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def full_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Logits at every prompt position from one prefill pass of our model."""
    engine = llm.engine
    seq = Sequence("probe", prompt, GREEDY, frozenset())
    engine.pages.grow(seq, len(prompt))
    try:
        ctx, input_ids = engine.runner._prepare([ScheduledSeq(seq, len(prompt))])
        ctx.logits_indices = torch.arange(len(prompt))
        with torch.inference_mode():
            return engine.runner.model(input_ids, ctx).float()
    finally:
        engine.pages.release(seq)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = build_tiny_model(request.param, folder)
    return hf_model, LLM(model=str(folder), page_size=4)


def test_tiny_logits_match_transformers(tiny):
    hf_model, llm = tiny
    prompt = torch.randint(2, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(full_logits(llm, prompt), expected, atol=1e-4, rtol=1e-4)


def test_tiny_greedy_matches_transformers(tiny):
    hf_model, llm = tiny
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 128, (n,), generator=gen).tolist() for n in (5, 17, 33)]
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(hf_model, prompt, 32)
        assert out.finish_reason == "length"


def test_unknown_architecture_fails_before_loading(tmp_path):
    build_tiny_model("llama", tmp_path)
    config = (tmp_path / "config.json").read_text().replace("LlamaForCausalLM", "GPT9ForCausalLM")
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ValueError, match="unsupported architecture.*GPT9ForCausalLM"):
        LLM(model=str(tmp_path))


@pytest.fixture(scope="module")
def default_pair():
    """Our engine and transformers, both on the converted default model in fp32."""
    llm = LLM(page_size=16)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=torch.float32)
    return hf_model.eval(), llm


def test_default_model_logits_match_transformers(default_pair):
    hf_model, llm = default_pair
    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(full_logits(llm, prompt), expected, atol=2e-3, rtol=1e-3)


def test_default_model_greedy_matches_transformers(default_pair):
    hf_model, llm = default_pair
    chats = ["What is the capital of France?", "Write a short poem about autumn.", "Explain recursion."]
    template = llm.tokenizer.apply_chat_template
    prompts = [
        llm.tokenizer.encode(template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False))
        for c in chats
    ]
    prompts.append(llm.tokenizer.encode("def quicksort(items):"))
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(hf_model, prompt, 40)
