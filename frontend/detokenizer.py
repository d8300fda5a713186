"""The detokenizer process: token ids in, UTF-8-safe text deltas out, stop strings applied.

Per sample, an IncrementalDecoder turns new token ids into text without ever ending on half
a character, and a StopMatcher holds back text that might be the start of a stop string.
When a stop string matches, the text is cut before it and the scheduler is told to stop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from engine.outputs import RequestOutput, TokenLogprob
from frontend.tokens import TokenPieces, load_tokenizer, make_decode
from ipc.messages import (
    DetokSetup,
    EngineInfo,
    Finish,
    TextBatch,
    TextDelta,
    TextLogprob,
    ToDetokenizer,
    TokenBatch,
    TopLogprob,
    Usage,
)
from ipc.process import ParentLink
from ipc.sockets import PullSocket, PushSocket, SocketPaths

logger = logging.getLogger(__name__)
REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Decodes a growing token sequence into text deltas that never split a character.

    The prefix/read-offset technique (vLLM, HF TextStreamer): decode a short window twice,
    with and without the new tokens, and emit the difference once it no longer ends in the
    replacement character, i.e. once the last character's bytes are all there. Decoding
    from `prefix_offset` rather than from the new token alone keeps the tokenizer's spacing
    rules (a SentencePiece leading space, say) intact.
    """

    def __init__(self, decode: Callable[[list[int]], str], context: list[int] = ()):
        self.decode = decode
        self.ids = list(context)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return the text that is now complete (maybe empty)."""
        self.ids.extend(new_ids)
        prefix = self.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """At the end: whatever is still held, even if the model left a character unfinished."""
        prefix = self.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]


class StopMatcher:
    """Finds the earliest stop string in streamed text, also when it spans several deltas.

    Text that could still turn into a stop string (a suffix that is a proper prefix of one)
    is held back until the next delta decides; `flush` releases it at the end.
    """

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string matched)."""
        if not self.stops:
            return text, False
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[: min(hits)], True
        keep = self._partial_suffix(buf)
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that some stop string starts with."""
        for k in range(min(len(buf), self.longest - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0


class SampleText:
    """Text state of one sample (one `index` of a request)."""

    def __init__(self, decode: Callable[[list[int]], str], setup: DetokSetup):
        self.decoder = IncrementalDecoder(decode, setup.prompt_tail)
        self.matcher = StopMatcher(setup.stop)
        self.prefix = setup.echo_text or ""  # echoed prompt, sent ahead of the first text
        self.finished = False

    def update(self, out: RequestOutput) -> tuple[str, bool]:
        """Text to emit for this output, and whether a stop string ended the sample."""
        ids = out.new_token_ids
        if out.finish_reason == "stop":
            ids = ids[:-1]  # the EOS / stop token that ended it is not part of the text
        text = self.decoder.push(ids)
        if out.finished:
            text += self.decoder.flush()
        text, stopped = self.matcher.feed(text)
        if out.finished and not stopped:
            text += self.matcher.flush()
        text, self.prefix = self.prefix + text, ""
        self.finished = out.finished or stopped
        return text, stopped


class RequestText:
    """Detokenization state of one request: a SampleText per sample."""

    def __init__(self, setup: DetokSetup, decode: Callable[[list[int]], str], pieces: TokenPieces):
        self.setup = setup
        self.pieces = pieces
        self.samples = [SampleText(decode, setup) for _ in range(setup.n)]
        self.engine_running = set(range(setup.n))  # samples the engine is still computing

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.samples)

    def update(self, out: RequestOutput) -> TextDelta | None:
        if out.finished:
            self.engine_running.discard(out.index)
        sample = self.samples[out.index]
        if sample.finished:
            return None  # cut by a stop string; the engine's late tokens are dropped
        text, stopped = sample.update(out)
        logprobs = self._logprobs(out.logprobs) if self.setup.logprobs and out.logprobs else None
        if not (text or logprobs or sample.finished):
            return None  # a character still incomplete; nothing to say yet
        delta = TextDelta(rid=out.rid, index=out.index, text=text, logprobs=logprobs)
        if sample.finished:
            delta.finish_reason = "stop" if stopped else out.finish_reason
            delta.usage = Usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
            delta.tokenizer_worker = self.setup.tokenizer_worker
        return delta

    def _logprobs(self, entries: list[TokenLogprob]) -> list[TextLogprob]:
        result = []
        for entry in entries:
            top = []
            for token_id, logprob in entry.top:
                text, raw = self.pieces.get(token_id)
                top.append(TopLogprob(text, logprob, raw))
            text, raw = self.pieces.get(entry.token_id)
            result.append(TextLogprob(text, entry.logprob, raw, top))
        return result


class Detokenizer:
    """Turns TokenBatches into TextDeltas for every request it knows; no I/O, easy to test."""

    def __init__(self, tokenizer):
        self.pieces = TokenPieces(tokenizer)
        self.requests: dict[str, RequestText] = {}
        # One decode function per skip_special_tokens setting, shared by all requests.
        self._decoders = {skip: make_decode(tokenizer, skip) for skip in (True, False)}

    def process(self, batch: TokenBatch) -> tuple[list[TextDelta], list[str]]:
        """Return the deltas of this batch and the rids the scheduler should stop computing."""
        for setup in batch.started:
            decode = self._decoders[setup.skip_special_tokens]
            self.requests[setup.rid] = RequestText(setup, decode, self.pieces)
        deltas, stop_rids = [], []
        for out in batch.outputs:
            req = self.requests.get(out.rid)
            if req is None:
                continue  # already finished by stop strings; these are its abort outputs
            delta = req.update(out)
            if delta is not None:
                deltas.append(delta)
            if req.done:
                del self.requests[out.rid]
                if req.engine_running:
                    stop_rids.append(out.rid)
        return deltas, stop_rids


def run_detokenizer(link: ParentLink, paths: SocketPaths) -> None:
    """Process entry: wait for the model folder, load its tokenizer, then relay forever."""
    info = link.wait_message(EngineInfo)
    detok = Detokenizer(load_tokenizer(info.model_dir))
    ctx = zmq.Context()
    inbox = PullSocket(ctx, paths.detokenizer, ToDetokenizer)
    to_frontend = PushSocket(ctx, paths.frontend)
    to_scheduler = PushSocket(ctx, paths.scheduler)
    link.ready()
    while True:
        msg = inbox.recv()
        if not isinstance(msg, TokenBatch):
            to_frontend.send(msg)  # errors and stats pass straight through
            continue
        deltas, stop_rids = detok.process(msg)
        for rid in stop_rids:  # first, so the scheduler stops computing as soon as it can
            to_scheduler.send(Finish(rid))
        if deltas:
            to_frontend.send(TextBatch(deltas))
