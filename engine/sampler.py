"""Batched token sampling on the device: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

One `Sampler` call picks the next token of every running sequence from that step's logits.
All per-token work is tensor math over the whole batch; Python only walks the rows to read
their parameters. The order of the steps follows vLLM:

1. min_tokens: stop ids get -inf while a sequence is shorter than its min_tokens;
2. penalties: repetition (prompt + output), then frequency and presence (output only);
3. greedy rows (temperature 0) take the argmax;
4. other rows: divide by temperature, cut with top-k, then top-p, then min-p, then draw.
   Cuts are thresholds on the logit value, so ties with the last kept token are kept (as
   vLLM). top-k/top-p look at the 256 most likely tokens of a row first (torch.topk) and
   sort the whole row only when the cut is not settled inside them.

Logprobs are the log_softmax of the logits after steps 1-2 and before step 4: they describe
the distribution the request's penalties and min_tokens define, not one reshaped by the
sampling knobs (a top-k cut would give every excluded token -inf, and temperature would make
the numbers depend on a setting that is not part of the model's prediction).

Draws use inverse-CDF sampling: one uniform number per row, located in the row's cumulative
distribution. It is exact like multinomial sampling and needs one random number per row instead
of one per vocabulary entry, which on CPU is most of the cost of the exponential-race trick.
A seeded row's number is a pure hash of (seed, seed_offset, len(output_ids)), so its token
does not depend on the rest of the batch and replays identically after preemption.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams

# Below this, logits / temperature can overflow float32 to inf and turn softmax into NaN;
# the distribution is one-hot long before, so clamping changes no draw.
_MIN_TEMPERATURE = 1e-5
# top-k/top-p first look at this many most likely tokens of each row; only rows whose cut
# is not settled inside them pay for a full sort (a full CPU sort costs ~10x a top-256).
_CANDIDATES = 256
# Long rows are drawn from in two steps, first a block of this many tokens (see _inverse_cdf).
_BLOCK = 256
_MASK64 = (1 << 64) - 1


@dataclass
class SamplingRow:
    """One sequence's state for this step."""

    params: SamplingParams
    prompt_ids: list[int]  # repetition_penalty counts prompt + output tokens, as vLLM
    output_ids: list[int]  # tokens generated so far by this sequence
    stop_ids: frozenset[int]  # eos ids (none if ignore_eos) + stop_token_ids; min_tokens masks
    seed_offset: int = 0  # parallel sample i of one seeded request uses seed_offset=i

    @property
    def blocks_stops(self) -> bool:
        """True while min_tokens still forbids this row's stop ids."""
        return bool(self.stop_ids) and len(self.output_ids) < self.params.min_tokens


@dataclass
class SampleResult:
    """The chosen token of every row, and its logprobs where the row asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None for rows whose params.logprobs is None


class Sampler:
    """Picks one token per row from a [rows, vocab] float32 logits tensor.

    `seed` seeds the generator of unseeded rows, so a whole server run is reproducible
    for a fixed schedule; seeded rows never touch it.
    """

    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # Uniforms are drawn on CPU (one per row) and shipped in one copy: no per-row kernels.
        self._generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(rows)} sampling rows")
        logits = logits[:, : self.vocab_size]
        if all(_plain_greedy(row) for row in rows):
            return SampleResult(logits.argmax(dim=-1).tolist(), [None] * len(rows))
        # The masking and penalty steps write in place: then work on a private copy.
        writes = any(row.blocks_stops or row.params.has_penalties for row in rows)
        logits = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=writes)
        _block_stop_ids(logits, rows)
        _apply_penalties(logits, rows)
        tokens = self._choose(logits, rows)
        logprobs = _gather_logprobs(logits, tokens, rows)
        return SampleResult(tokens.tolist(), logprobs)

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Token ids [rows]: argmax for greedy rows, a random draw for the others."""
        drawn = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not drawn:
            return logits.argmax(dim=-1)
        if len(drawn) == len(rows):
            return self._draw(logits, rows)
        tokens = logits.argmax(dim=-1)
        index = torch.tensor(drawn, device=logits.device)
        tokens[index] = self._draw(logits[index], [rows[i] for i in drawn])
        return tokens

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Sample one token per row after temperature, top-k, top-p and min-p."""
        uniforms = self._uniforms(rows).to(logits.device)
        knobs = _Knobs.build(rows, self.vocab_size, uniforms)
        # Shifted so each row's max is 0: exp() cannot overflow, and min-p's floor is log(min_p).
        shifted = logits / knobs.temperature[:, None]
        shifted -= shifted.amax(dim=-1, keepdim=True)
        cutting = [_uses_top_k_top_p(row.params, self.vocab_size) for row in rows]
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        # Uncut rows go last: their draw consumes `shifted` when they are the whole batch.
        _fill_rows(tokens, [i for i, cut in enumerate(cutting) if cut], shifted, knobs, _draw_cut)
        _fill_rows(
            tokens, [i for i, cut in enumerate(cutting) if not cut], shifted, knobs, _draw_uncut
        )
        return tokens

    def _uniforms(self, rows: list[SamplingRow]) -> torch.Tensor:
        """One float64 in [0, 1) per row: hashed from the seed for seeded rows, else fresh."""
        fresh = torch.rand(len(rows), generator=self._generator, dtype=torch.float64).tolist()
        values = [
            fresh[i] if row.params.seed is None else _seeded_uniform(row)
            for i, row in enumerate(rows)
        ]
        return torch.tensor(values, dtype=torch.float64)


def _plain_greedy(row: SamplingRow) -> bool:
    """A row whose token is the raw argmax: nothing to mask, penalize or report."""
    params = row.params
    return (
        params.greedy
        and not params.has_penalties
        and params.logprobs is None
        and not row.blocks_stops
    )


# --- min_tokens and penalties (in place on the [rows, vocab] logits) -----------------------


def _block_stop_ids(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Forbid stop ids on rows still shorter than their min_tokens."""
    vocab = logits.shape[1]
    pairs = [
        (i, token)
        for i, row in enumerate(rows)
        if row.blocks_stops
        for token in row.stop_ids
        if 0 <= token < vocab
    ]
    if pairs:
        row_index, token_index = zip(*pairs, strict=True)
        logits[list(row_index), list(token_index)] = float("-inf")


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Apply repetition, frequency and presence penalties to the rows that set any."""
    chosen = [i for i, row in enumerate(rows) if row.params.has_penalties]
    if not chosen:
        return
    if len(chosen) == len(rows):
        _penalize(logits, rows)
        return
    index = torch.tensor(chosen, device=logits.device)
    part = logits[index]
    _penalize(part, [rows[i] for i in chosen])
    logits[index] = part


def _penalize(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """vLLM's penalties on rows that all set one, in place on contiguous [rows, vocab] logits.

    Only the (row, token) pairs that occur are read and written: prompts and outputs are
    far shorter than rows * vocab, so this beats dense [rows, vocab] count tensors.
    """
    vocab, flat = logits.shape[1], logits.view(-1)
    factors = torch.tensor(
        [
            (r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty)
            for r in rows
        ],
        dtype=torch.float32,
    ).to(logits.device)
    repetition, frequency, presence = factors.unbind(dim=1)
    if any(row.params.repetition_penalty != 1.0 for row in rows):
        # Prompt ids only matter where repetition_penalty is set: skip the others'.
        seen_lists = [
            r.prompt_ids + r.output_ids if r.params.repetition_penalty != 1.0 else [] for r in rows
        ]
        seen, _ = _occurrences(seen_lists, vocab, logits.device)
        values, factor = flat[seen], repetition[seen // vocab]
        flat[seen] = torch.where(values > 0, values / factor, values * factor)
    keys, counts = _occurrences([row.output_ids for row in rows], vocab, logits.device)
    owner = keys // vocab
    flat[keys] -= frequency[owner] * counts + presence[owner]


def _occurrences(
    id_lists: list[list[int]], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct (list index, token) pairs as flat keys index * vocab + token, with counts.

    Built on CPU, where the ids already are, so the device gets two small tensors and never
    waits on a data-dependent size. Ids outside the vocabulary are dropped.
    """
    ids = torch.tensor(list(itertools.chain.from_iterable(id_lists)), dtype=torch.long)
    owner = torch.repeat_interleave(
        torch.arange(len(id_lists)), torch.tensor([len(one) for one in id_lists])
    )
    valid = (ids >= 0) & (ids < vocab)
    keys, counts = torch.unique(owner[valid] * vocab + ids[valid], return_counts=True)
    return keys.to(device), counts.to(device=device, dtype=torch.float32)


# --- temperature, top-k, top-p, min-p --------------------------------------------------------


@dataclass
class _Knobs:
    """Per-row sampling parameters as device tensors; disabled filters get neutral values."""

    temperature: torch.Tensor  # [rows] float32, clamped away from 0
    top_k: torch.Tensor  # [rows] int64, vocab when disabled
    top_p: torch.Tensor  # [rows] float32, inf when disabled (so no cumulative sum reaches it)
    log_min_p: torch.Tensor  # [rows] float32, -inf when disabled
    uniform: torch.Tensor  # [rows] float64 in [0, 1): where each row's draw lands in its CDF
    max_k: int  # the largest enabled top_k of the batch, 0 if none
    any_min_p: bool
    any_top_p_alone: bool  # some row has top-p without top-k: it needs the full normalizer

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab: int, uniform: torch.Tensor) -> _Knobs:
        table = torch.tensor([_knob_values(row.params, vocab) for row in rows], dtype=torch.float64)
        table = table.to(uniform.device)
        return cls(
            temperature=table[:, 0].float(),
            top_k=table[:, 1].long(),
            top_p=table[:, 2].float(),
            log_min_p=table[:, 3].log().float(),
            uniform=uniform,
            max_k=max((k for r in rows if 0 < (k := r.params.top_k) < vocab), default=0),
            any_min_p=any(row.params.min_p > 0.0 for row in rows),
            any_top_p_alone=any(
                r.params.top_p < 1.0 and not 0 < r.params.top_k < vocab for r in rows
            ),
        )

    def select(self, index: torch.Tensor) -> _Knobs:
        """The knobs of the rows at `index`."""
        return _Knobs(
            temperature=self.temperature[index],
            top_k=self.top_k[index],
            top_p=self.top_p[index],
            log_min_p=self.log_min_p[index],
            uniform=self.uniform[index],
            max_k=self.max_k,
            any_min_p=self.any_min_p,
            any_top_p_alone=self.any_top_p_alone,
        )


def _knob_values(params: SamplingParams, vocab: int) -> tuple[float, float, float, float]:
    """(temperature, top_k, top_p, min_p) with neutral stand-ins for disabled filters."""
    top_k = params.top_k if 0 < params.top_k < vocab else vocab
    top_p = params.top_p if params.top_p < 1.0 else float("inf")
    return (max(params.temperature, _MIN_TEMPERATURE), top_k, top_p, params.min_p)


def _uses_top_k_top_p(params: SamplingParams, vocab: int) -> bool:
    return 0 < params.top_k < vocab or params.top_p < 1.0


def _fill_rows(
    tokens: torch.Tensor,
    members: list[int],
    shifted: torch.Tensor,
    knobs: _Knobs,
    draw: Callable[[torch.Tensor, _Knobs], torch.Tensor],
) -> None:
    """tokens[members] = draw(those rows), without copying when members is every row."""
    if len(members) == len(tokens):
        tokens.copy_(draw(shifted, knobs))
    elif members:
        index = torch.tensor(members, device=tokens.device)
        tokens[index] = draw(shifted[index], knobs.select(index))


def _draw_uncut(shifted: torch.Tensor, knobs: _Knobs) -> torch.Tensor:
    """Draw for rows without top-k/top-p: the whole row, less what min-p drops."""
    floor = knobs.log_min_p if knobs.any_min_p else None
    return _draw_from_row(shifted, floor, knobs.uniform)


def _draw_cut(shifted: torch.Tensor, knobs: _Knobs) -> torch.Tensor:
    """Draw for rows with top-k and/or top-p, among each row's most likely tokens.

    Cuts are thresholds on the logit value ("floors"), so tokens tied with the last kept one
    are kept too (as vLLM): no result depends on the order of ties.
    """
    vocab = shifted.shape[1]
    # One more than any top_k, so a top-k cut leaves a smaller value after it in the window.
    width = min(vocab, max(_CANDIDATES, knobs.max_k + 1))
    # The normalizer of rows without top-k (rows with top-k renormalize inside it).
    if knobs.any_top_p_alone:
        full_lse = shifted.exp().sum(dim=-1).log()  # the row max is 0: exp cannot overflow
    else:
        full_lse = shifted.new_zeros(shifted.shape[0])
    values, ids = shifted.topk(width, dim=-1)
    floor, settled = _cut(values, knobs.top_k, knobs.top_p, full_lse, vocab)
    floor = torch.maximum(floor, knobs.log_min_p)
    if width < vocab:
        settled &= values[:, -1] < floor  # else tokens past the window may tie the floor
    tokens = _draw_from_window(values, ids, floor, knobs.uniform)
    if not bool(settled.all()):
        redo = (~settled).nonzero().squeeze(1)
        tokens[redo] = _draw_after_full_sort(shifted[redo], knobs.select(redo), full_lse[redo])
    return tokens


def _draw_after_full_sort(
    shifted: torch.Tensor, knobs: _Knobs, full_lse: torch.Tensor
) -> torch.Tensor:
    """The rare rows whose cut reaches past the window: find the floor by a full sort."""
    values = shifted.sort(dim=-1, descending=True).values
    floor, _ = _cut(values, knobs.top_k, knobs.top_p, full_lse, shifted.shape[1])
    return _draw_from_row(shifted, torch.maximum(floor, knobs.log_min_p), knobs.uniform)


def _cut(
    values: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    full_lse: torch.Tensor,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k, then top-p renormalized after top-k, on the descending prefix `values`.

    Returns the smallest kept value per row and whether the prefix was long enough to
    settle the cut (top-k inside it, and top-p's mass reached inside it).
    """
    width = values.shape[1]
    in_top_k = torch.arange(width, device=values.device)[None, :] < top_k[:, None]
    top_k_lse = values.masked_fill(~in_top_k, float("-inf")).logsumexp(dim=-1)
    lse = torch.where(top_k < vocab, top_k_lse, full_lse)
    probs = torch.exp(values - lse[:, None]).masked_fill_(~in_top_k, 0.0)
    mass = probs.cumsum(dim=-1)
    # Keep a token while the mass strictly before it is below top_p: the smallest set reaching it.
    kept = ((mass - probs) < top_p[:, None]) & in_top_k
    last = kept.sum(dim=-1).clamp_(min=1) - 1
    settled = (top_k <= width) | (mass[:, -1] >= top_p)
    return values.gather(1, last[:, None]).squeeze(1), settled


# --- drawing ---------------------------------------------------------------------------------


def _draw_from_row(
    shifted: torch.Tensor, floor: torch.Tensor | None, uniform: torch.Tensor
) -> torch.Tensor:
    """Token ids drawn from exp(shifted) over whole rows, zeroing values below `floor`.

    Consumes `shifted`: its memory becomes the weights, which saves a [rows, vocab] buffer.
    """
    keep = None if floor is None else shifted >= floor[:, None]
    weights = shifted.exp_()
    if keep is not None:
        weights.mul_(keep)
    return _inverse_cdf(weights, uniform)


def _draw_from_window(
    values: torch.Tensor, ids: torch.Tensor, floor: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor:
    """Token ids drawn among candidate (value, id) pairs, zeroing values below `floor`.

    The candidates are put back in token-id order first: their CDF is then the one
    `_draw_from_row` builds (which only adds zero-width tokens between them), so a seeded
    row draws the same token whichever path it takes.
    """
    ids, order = ids.sort(dim=-1)
    values = values.gather(1, order)
    weights = values.exp().mul_(values >= floor[:, None])
    return ids.gather(1, _inverse_cdf(weights, uniform)[:, None]).squeeze(1)


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[rows] column indices drawn in proportion to `weights`, by locating uniforms in the CDF.

    Long rows take two steps: a block of _BLOCK columns by its mass, then a column inside
    it by where the target fell within the block. That is the same draw as one cumulative
    sum over the row, but the float64 sums cover [rows, blocks] and one block per row
    instead of a [rows, vocab] float64 copy.
    """
    rows, width = weights.shape
    if width <= _BLOCK:
        return _locate(weights.double().cumsum(dim=-1), uniforms)[0]
    if width % _BLOCK:
        weights = torch.nn.functional.pad(weights, (0, -width % _BLOCK))
    blocks = weights.view(rows, -1, _BLOCK)
    block, fraction = _locate(blocks.sum(dim=-1).double().cumsum(dim=-1), uniforms)
    inside = blocks[torch.arange(rows, device=weights.device), block]
    column, _ = _locate(inside.double().cumsum(dim=-1), fraction)
    return block * _BLOCK + column


def _locate(cdf: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The column of each row's CDF that uniform * total falls in, and where inside it.

    The target stays strictly below the total, so a rounding accident cannot pick the last
    column when it has zero weight; zero-weight columns have zero width and are never hit.
    The second result, in [0, 1], is the target's position within the chosen column.
    """
    total = cdf[:, -1:]
    target = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, cdf.new_zeros(())))
    index = torch.searchsorted(cdf, target, right=True)
    upper = cdf.gather(1, index)
    lower = torch.where(index > 0, cdf.gather(1, (index - 1).clamp_(min=0)), 0.0)
    return index.squeeze(1), ((target - lower) / (upper - lower)).squeeze(1)


def _seeded_uniform(row: SamplingRow) -> float:
    """A float in [0, 1) that depends only on (seed, seed_offset, len(output_ids))."""
    state = 0
    for part in (row.params.seed or 0, row.seed_offset, len(row.output_ids)):
        state = _splitmix64(state ^ (part & _MASK64))
    return (state >> 11) * 2.0**-53


def _splitmix64(x: int) -> int:
    """SplitMix64's step and finalizer (Steele et al.): a bijective 64-bit mixer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


# --- logprobs --------------------------------------------------------------------------------


def _gather_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]
) -> list[TokenLogprob | None]:
    """The chosen token's logprob and the top-k alternatives, for rows that asked."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(rows)
    if not wanted:
        return result
    index = torch.tensor(wanted, device=logits.device)
    logprobs = torch.log_softmax(logits[index], dim=-1)
    chosen_ids = tokens[index]
    chosen = logprobs.gather(1, chosen_ids[:, None]).squeeze(1).tolist()
    max_k = max(rows[i].params.logprobs or 0 for i in wanted)
    top_values, top_ids = logprobs.topk(max_k, dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for j, (i, token) in enumerate(zip(wanted, chosen_ids.tolist(), strict=True)):
        k = rows[i].params.logprobs or 0
        top = list(zip(top_ids[j][:k], top_values[j][:k], strict=True))
        result[i] = TokenLogprob(token_id=token, logprob=chosen[j], top=top)
    return result
