"""Tests for engine.sampler: greedy, penalties, min_tokens, filters, seeds, logprobs."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.sampler import Sampler, SamplingRow, _inverse_cdf
from engine.sampling_params import SamplingParams

CPU = torch.device("cpu")


def make_row(
    output_ids: tuple[int, ...] = (),
    prompt_ids: tuple[int, ...] = (),
    stop_ids: tuple[int, ...] = (),
    seed_offset: int = 0,
    **params: object,
) -> SamplingRow:
    return SamplingRow(
        params=SamplingParams(**params),
        prompt_ids=list(prompt_ids),
        output_ids=list(output_ids),
        stop_ids=frozenset(stop_ids),
        seed_offset=seed_offset,
    )


def tokens_of(logits: torch.Tensor, rows: list[SamplingRow], seed: int = 0) -> list[int]:
    return Sampler(logits.shape[1], CPU, seed=seed)(logits, rows).token_ids


def counts_of(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double()


def assert_frequencies(tokens: list[int], probs: torch.Tensor) -> None:
    """Empirical frequencies within 5 sigma (plus one count) of the expected ones."""
    n = len(tokens)
    observed = counts_of(tokens, probs.numel())
    expected = probs.double() * n
    sigma = torch.sqrt(expected * (1 - probs.double()))
    excess = (observed - expected).abs() - (5 * sigma + 1)
    assert (excess <= 0).all(), f"observed {observed.tolist()} expected {expected.tolist()}"


# A small fixed distribution with well-separated probabilities (no filter boundary is close).
SMALL_LOGITS = torch.tensor([2.0, 0.3, 1.1, -1.0, 2.6, 0.0, -0.4, 1.7, -2.0, 0.8, 0.5, -0.2])
SMALL_PROBS = torch.softmax(SMALL_LOGITS, dim=0)
N_DRAWS = 4000


def draw_small(seed: int = 0, **params: object) -> list[int]:
    logits = SMALL_LOGITS.expand(N_DRAWS, -1).contiguous()
    return tokens_of(logits, [make_row(**params) for _ in range(N_DRAWS)], seed=seed)


# --- greedy and penalties --------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = torch.randn(9, 50, generator=torch.Generator().manual_seed(1))
    result = Sampler(50, CPU)(logits, [make_row(temperature=0.0) for _ in range(9)])
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.logprobs == [None] * 9


def test_columns_beyond_vocab_are_ignored() -> None:
    logits = torch.zeros(40, 12)
    logits[:, 10:] = 100.0  # padding columns of a wider LM head
    sampler = Sampler(10, CPU)
    assert sampler(logits[:1], [make_row(temperature=0.0)]).token_ids == [0]
    sampled = sampler(logits, [make_row() for _ in range(40)]).token_ids
    assert max(sampled) < 10 and len(set(sampled)) > 3


def test_greedy_penalties_match_hand_computed_logits() -> None:
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, 3.0, -0.5, 0.9],
            [0.2, 1.0, -2.0, 0.5, 0.0, -1.0],
            [0.2, 1.0, -2.0, 0.5, 0.0, -1.0],
        ]
    )
    rows = [
        make_row(output_ids=(3, 3, 4), prompt_ids=(0, 9), temperature=0.0, logprobs=6,
                 repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        make_row(output_ids=(5, 5, 5), prompt_ids=(2,), temperature=0.0, logprobs=6,
                 repetition_penalty=0.5, frequency_penalty=-0.2, presence_penalty=0.1),
        make_row(output_ids=(1, 1), prompt_ids=(1,), temperature=0.0, logprobs=6),
    ]  # fmt: skip
    # Row 0: repetition on {0, 3, 4} (prompt + output; id 9 is outside the vocabulary):
    # 2/2, 3/2, -0.5*2; then token 3 (twice) loses 2*0.5 + 0.25, token 4 (once) 0.5 + 0.25.
    # Row 1: repetition 0.5 on {2, 5}: -2*0.5, -1*0.5; token 5 (3x) gains 0.6, loses 0.1.
    expected = torch.tensor(
        [
            [1.0, -1.0, 0.5, 1.5 - 1.0 - 0.25, -1.0 - 0.5 - 0.25, 0.9],
            [0.2, 1.0, -1.0, 0.5, 0.0, -0.5 + 0.6 - 0.1],
            [0.2, 1.0, -2.0, 0.5, 0.0, -1.0],
        ]
    )
    result = Sampler(6, CPU)(logits, rows)
    assert result.token_ids == [0, 1, 1]
    assert logits.argmax(dim=-1).tolist() == [3, 1, 1]  # the penalties changed row 0's pick
    want = torch.log_softmax(expected, dim=-1)
    for i, entry in enumerate(result.logprobs):
        got = torch.full((6,), float("nan"))
        for token, logprob in entry.top:
            got[token] = logprob
        torch.testing.assert_close(got, want[i])


def test_penalties_and_min_tokens_do_not_touch_the_callers_logits() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    before = logits.clone()
    tokens_of(logits, [make_row(output_ids=(2,), temperature=0.0, repetition_penalty=5.0)])
    tokens_of(logits, [make_row(stop_ids=(2,), min_tokens=1, presence_penalty=1.0)])
    assert torch.equal(logits, before)


# --- min_tokens --------------------------------------------------------------------------------


def test_min_tokens_blocks_the_stop_id_until_reached() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.5, 9.0, 0.2]]).expand(4, -1).contiguous()
    rows = [
        make_row(output_ids=(1,) * n, stop_ids=(3,), temperature=0.0, min_tokens=3)
        for n in range(4)
    ]
    assert tokens_of(logits, rows) == [1, 1, 1, 3]


def test_min_tokens_blocks_sampled_rows_and_extra_stop_ids() -> None:
    logits = torch.tensor([[0.0, 1.0, 8.0, 9.0, 0.2]]).expand(400, -1).contiguous()
    short = [make_row(output_ids=(0,), stop_ids=(2, 3), min_tokens=2) for _ in range(200)]
    done = [make_row(output_ids=(0, 0), stop_ids=(2, 3), min_tokens=2) for _ in range(200)]
    tokens = tokens_of(logits, short + done)
    assert not {2, 3} & set(tokens[:200])
    assert set(tokens[200:]) <= {0, 1, 2, 3, 4} and tokens[200:].count(3) > 100


# --- filters and sampling statistics -----------------------------------------------------------


def test_temperature_one_matches_softmax() -> None:
    assert_frequencies(draw_small(temperature=1.0), SMALL_PROBS)


def test_temperature_scales_the_distribution() -> None:
    assert_frequencies(draw_small(temperature=0.5), torch.softmax(SMALL_LOGITS / 0.5, dim=0))


def test_top_k_keeps_only_the_k_largest_renormalized() -> None:
    tokens = draw_small(top_k=3)
    top3 = SMALL_LOGITS.topk(3).indices
    assert set(tokens) == set(top3.tolist())
    renormalized = torch.zeros(12)
    renormalized[top3] = torch.softmax(SMALL_LOGITS[top3], dim=0)
    assert_frequencies(tokens, renormalized)


def nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    """The smallest set of most likely tokens whose mass reaches top_p."""
    order = probs.argsort(descending=True).tolist()
    kept, mass = set(), 0.0
    for token in order:
        kept.add(token)
        mass += probs[token].item()
        if mass >= top_p:
            return kept
    return kept


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    allowed = nucleus(SMALL_PROBS, 0.6)
    assert 2 < len(allowed) < 12
    assert set(draw_small(top_p=0.6)) == allowed


def test_top_p_applies_after_top_k_renormalization() -> None:
    top4 = SMALL_LOGITS.topk(4).indices
    renormalized = torch.zeros(12)
    renormalized[top4] = torch.softmax(SMALL_LOGITS[top4], dim=0)
    allowed = nucleus(renormalized, 0.7)
    assert allowed != nucleus(SMALL_PROBS, 0.7)  # the order of the two cuts matters here
    assert set(draw_small(top_k=4, top_p=0.7)) == allowed


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    allowed = {i for i, p in enumerate(SMALL_PROBS.tolist()) if p >= 0.2 * SMALL_PROBS.max()}
    assert 2 < len(allowed) < 12
    assert set(draw_small(min_p=0.2)) == allowed


def test_rows_without_filters_are_unaffected_by_filtering_rows() -> None:
    logits = SMALL_LOGITS.expand(2 * N_DRAWS, -1).contiguous()
    rows = [
        make_row(top_k=2, top_p=0.5, min_p=0.5) if i % 2 else make_row() for i in range(2 * N_DRAWS)
    ]
    tokens = tokens_of(logits, rows)
    assert_frequencies(tokens[0::2], SMALL_PROBS)
    assert set(tokens[1::2]) <= set(SMALL_LOGITS.topk(2).indices.tolist())


def test_cuts_wider_than_the_candidate_window() -> None:
    vocab = 2000
    flat = -0.002 * torch.arange(vocab, dtype=torch.float32)  # top-p 0.5 needs ~350 tokens
    peaked = 100 * flat  # ... here a handful, settled without the full sort
    flat_cut = max(nucleus(torch.softmax(flat.double(), dim=0), 0.5))
    peaked_set = nucleus(torch.softmax(peaked.double(), dim=0), 0.5)
    logits = torch.stack([flat] * 150 + [peaked] * 150)
    tokens = tokens_of(logits, [make_row(top_p=0.5) for _ in range(300)])
    assert flat_cut > 300 and 256 < max(tokens[:150]) <= flat_cut
    assert len(peaked_set) > 1 and set(tokens[150:]) == peaked_set
    top_k_tokens = tokens_of(logits[:150], [make_row(top_k=600) for _ in range(150)])
    assert 256 < max(top_k_tokens) < 600


def test_ties_with_the_floor_past_the_window_are_kept() -> None:
    # 200 distinct leaders, then 300 tokens tied at 0.9: top_k=210 cuts inside the tie, and
    # every tied token stays, also the ~250 that torch.topk's 256-wide window leaves out.
    logits = torch.full((1000,), -5.0)
    logits[:200] = 1.0 + 0.001 * torch.arange(200)
    logits[200:500] = 0.9
    shuffle = torch.randperm(1000, generator=torch.Generator().manual_seed(4))
    logits, tied = logits[shuffle], set(torch.nonzero(logits[shuffle] == 0.9).flatten().tolist())
    tokens = tokens_of(logits.expand(1000, -1).contiguous(), [make_row(top_k=210)] * 1000)
    assert set(tokens) <= set(torch.nonzero(logits > 0).flatten().tolist())
    assert len(tied & set(tokens)) > 100


@pytest.mark.parametrize("width", [4, 1000])  # one step, and two steps through blocks
def test_draw_edges_never_pick_zero_weight_tokens(width: int) -> None:
    weights = torch.zeros(2, width)
    weights[:, [1, width - 2]] = 1.0  # zero-weight tokens before, between and after
    edges = torch.tensor([0.0, 1.0 - 2.0**-53], dtype=torch.float64)
    assert _inverse_cdf(weights, edges).tolist() == [1, width - 2]


def test_frequencies_across_block_boundaries() -> None:
    # The small distribution spread over ids at and around the 256-token block edges.
    logits = torch.full((1000,), -4.0)
    ids = [0, 250, 255, 256, 257, 511, 512, 700, 767, 768, 998, 999]
    logits[ids] = SMALL_LOGITS
    rows = [make_row(seed=i) if i % 2 else make_row() for i in range(N_DRAWS)]
    tokens = tokens_of(logits.expand(N_DRAWS, -1).contiguous(), rows)
    assert_frequencies(tokens, torch.softmax(logits, dim=0))


@pytest.mark.parametrize("temperature", [1e-5, 1e-38])
def test_tiny_temperature_is_argmax_without_nan(temperature: float) -> None:
    logits = torch.randn(20, 300, generator=torch.Generator().manual_seed(2)) * 1e3
    rows = [make_row(temperature=temperature, top_p=0.9, min_p=0.1, logprobs=2) for _ in range(20)]
    result = Sampler(300, CPU)(logits, rows)
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert all(math.isfinite(entry.logprob) for entry in result.logprobs)


def test_random_filter_settings_stay_inside_a_reference_cut() -> None:
    rng = random.Random(3)
    for _ in range(60):
        vocab = rng.choice([5, 40, 300])
        logits = torch.randn(vocab, generator=torch.Generator().manual_seed(rng.randrange(10**6)))
        params = dict(
            temperature=rng.choice([0.3, 1.0, 2.0]),
            top_k=rng.choice([-1, 1, 2, 7, 50]),
            top_p=rng.choice([1.0, 0.95, 0.5, 0.1]),
            min_p=rng.choice([0.0, 0.05, 0.3]),
        )
        allowed = reference_allowed(logits.double(), **params)
        tokens = tokens_of(logits.expand(50, -1).contiguous(), [make_row(**params)] * 50)
        assert set(tokens) <= allowed, params


def reference_allowed(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> set[int]:
    """Tokens that top-k, then top-p, then min-p keep, written the slow obvious way."""
    probs = torch.softmax(logits / temperature, dim=0)
    order = probs.argsort(descending=True).tolist()
    if top_k > 0:
        order = order[:top_k]
    mass = sum(probs[t].item() for t in order)
    kept, running = [], 0.0
    for token in order:
        kept.append(token)
        running += probs[token].item() / mass
        if running >= top_p - 1e-6:  # loose on purpose: float32 rounding near the boundary
            break
    best = probs[order[0]].item()
    return {t for t in kept if probs[t].item() >= min_p * best * (1 - 1e-5)}


# --- seeds ---------------------------------------------------------------------------------------

SEED_VOCAB = 500
SEED_LOGITS = torch.randn(SEED_VOCAB, generator=torch.Generator().manual_seed(5))


def random_companions(rng: random.Random, count: int) -> list[SamplingRow]:
    choices = [
        lambda: make_row(temperature=0.0),
        lambda: make_row(temperature=0.9, top_p=0.8),
        lambda: make_row(top_k=5, logprobs=2),
        lambda: make_row(top_k=400, min_p=0.01),
        lambda: make_row(seed=rng.randrange(100), output_ids=(1, 2)),
        lambda: make_row(repetition_penalty=1.5, output_ids=(3,), prompt_ids=(4, 5)),
    ]
    return [rng.choice(choices)() for _ in range(count)]


def draw_in_company(target: SamplingRow, rng: random.Random, sampler_seed: int) -> int:
    """The target row's token when placed at a random position among random other rows."""
    rows = random_companions(rng, rng.randrange(0, 12))
    position = rng.randrange(len(rows) + 1)
    rows.insert(position, target)
    logits = torch.randn(
        len(rows), SEED_VOCAB, generator=torch.Generator().manual_seed(rng.randrange(10**6))
    )
    logits[position] = SEED_LOGITS
    return Sampler(SEED_VOCAB, CPU, seed=sampler_seed)(logits, rows).token_ids[position]


def test_seeded_row_ignores_its_batch_companions() -> None:
    rng = random.Random(7)
    for params in [
        dict(seed=11),
        dict(seed=12, top_p=0.9, temperature=1.3),
        dict(seed=13, top_k=40),
    ]:
        target = make_row(output_ids=(9, 9, 9), **params)
        alone = tokens_of(SEED_LOGITS[None, :], [target])[0]
        assert {draw_in_company(target, rng, sampler_seed=s) for s in range(8)} == {alone}


def test_seeded_draws_follow_the_distribution() -> None:
    rows = [
        make_row(seed=i // 4, seed_offset=i % 4, output_ids=(0,) * (i % 3)) for i in range(N_DRAWS)
    ]
    tokens = tokens_of(SMALL_LOGITS.expand(N_DRAWS, -1).contiguous(), rows)
    assert_frequencies(tokens, SMALL_PROBS)


def test_seeded_draw_is_the_same_inside_or_past_the_candidate_window() -> None:
    # top_p set so the nucleus holds ~280 tokens: alone, the 256-token window cannot settle
    # the cut (full-sort path); next to a top_k=300 row the window is 301 wide and does.
    probs = torch.softmax(SEED_LOGITS.double(), dim=0).sort(descending=True).values
    top_p = probs[:280].sum().item()
    wide = make_row(top_k=300)
    for seed in range(40):
        target = make_row(seed=seed, top_p=top_p)
        alone = tokens_of(SEED_LOGITS[None, :], [target])[0]
        paired = tokens_of(torch.stack([SEED_LOGITS, SEED_LOGITS]), [wide, target])[1]
        assert alone == paired, seed


def test_seed_offset_and_length_change_the_draw() -> None:
    def draw(offset: int, length: int, seed: int = 21) -> int:
        row = make_row(seed=seed, seed_offset=offset, output_ids=(0,) * length)
        return tokens_of(SEED_LOGITS[None, :], [row])[0]

    assert len({draw(offset, 4) for offset in range(8)}) >= 5
    assert len({draw(0, length) for length in range(8)}) >= 5
    assert len({draw(0, 4, seed) for seed in range(8)}) >= 5
    assert draw(3, 4) == draw(3, 4)


def test_seeded_sequence_replays_with_different_companions() -> None:
    def generate(rng: random.Random, sampler_seed: int) -> list[int]:
        output: list[int] = []
        for _ in range(20):
            target = make_row(seed=99, seed_offset=1, output_ids=tuple(output), temperature=1.2)
            output.append(draw_in_company(target, rng, sampler_seed))
        return output

    first = generate(random.Random(1), sampler_seed=0)
    assert generate(random.Random(2), sampler_seed=5) == first
    assert len(set(first)) > 10  # really random draws, not a constant


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    logits = SEED_LOGITS.expand(30, -1).contiguous()
    rows = [make_row() for _ in range(30)]
    assert tokens_of(logits, rows, seed=4) == tokens_of(logits, rows, seed=4)
    assert tokens_of(logits, rows, seed=4) != tokens_of(logits, rows, seed=6)
    sampler = Sampler(SEED_VOCAB, CPU)
    assert sampler(logits, rows).token_ids != sampler(logits, rows).token_ids


# --- logprobs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 5])
def test_logprobs_report_the_chosen_token_and_sorted_top_k(k: int) -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(k))
    rows = [make_row(temperature=0.7, top_k=20, logprobs=k) for _ in range(5)]
    rows.append(make_row(temperature=0.7))
    result = Sampler(100, CPU)(logits, rows)
    reference = torch.log_softmax(logits, dim=-1)  # before temperature and top-k, by design
    assert result.logprobs[5] is None
    for i, entry in enumerate(result.logprobs[:5]):
        token = result.token_ids[i]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(reference[i, token].item(), abs=1e-5)
        assert [t for t, _ in entry.top] == reference[i].topk(k).indices.tolist()
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True) and len(values) == k
        assert values == pytest.approx(reference[i].topk(k).values.tolist(), abs=1e-5)


def test_logprobs_see_min_tokens_masking() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0]])
    rows = [make_row(stop_ids=(2,), min_tokens=1, temperature=0.0, logprobs=3)]
    entry = Sampler(3, CPU)(logits, rows).logprobs[0]
    assert entry.token_id == 1 and entry.top[-1] == (2, float("-inf"))


# --- mixed batches -------------------------------------------------------------------------------


def test_mixed_batch_rows_behave_as_alone() -> None:
    vocab = 64
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(8))
    rows = [
        make_row(temperature=0.0),
        make_row(temperature=0.8, top_p=0.9, seed=1),
        make_row(temperature=0.0, output_ids=(5, 6, 6), prompt_ids=(1,), repetition_penalty=1.3,
                 frequency_penalty=0.4, presence_penalty=0.2),
        make_row(temperature=1.1, top_k=10, min_p=0.05, seed=2, logprobs=4, output_ids=(7,)),
        make_row(temperature=0.0, output_ids=(), stop_ids=(3,), min_tokens=2, logprobs=0),
        make_row(temperature=1.0),
    ]  # fmt: skip
    together = Sampler(vocab, CPU)(logits, rows)
    for i in range(5):
        alone = Sampler(vocab, CPU, seed=123)(logits[i : i + 1], [rows[i]])
        assert together.token_ids[i] == alone.token_ids[0], i
        if alone.logprobs[0] is None:
            assert together.logprobs[i] is None
        else:
            assert together.logprobs[i].token_id == alone.logprobs[0].token_id
            assert together.logprobs[i].logprob == pytest.approx(
                alone.logprobs[0].logprob, abs=1e-6
            )
            assert [t for t, _ in together.logprobs[i].top] == [t for t, _ in alone.logprobs[0].top]
    assert 0 <= together.token_ids[5] < vocab


def test_empty_batch() -> None:
    result = Sampler(10, CPU)(torch.zeros(0, 10), [])
    assert result.token_ids == [] and result.logprobs == []
