"""One generation request answered over HTTP: each of its choices' outputs turned into text and
logprobs, and the whole reply or its stream of chunks.

A request asks for `prompts x best_of` samples, each a request of its own on a rank
(`GenerationRequest.sample_params`), its text and kept tokens followed by `SampleText`
(launcher/samples.py, as the offline `LLM` follows them); `best_of > n` keeps the `n`
samples of each prompt with the best cumulative logprob. Streaming interleaves the choices'
chunks as their tokens come, each chunk carrying its choice's index.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from dist_engine.engine.outputs import ErrorKind, RequestOutput, TokenLogprob
from launcher.samples import Piece, SampleText
from launcher.server.frontend import RequestStream
from launcher.server.metrics import RequestTimer
from launcher.server.protocol import GenerationRequest, RequestError
from launcher.server.reasoning import ReasoningSplitter, prompt_end
from launcher.server.responses import ResponseShape, Usage, sse
from launcher.server.tokenization import ModelTokenizer
from launcher.server.tools import ToolCall, ToolCallReader, finish_reason


class Choice:
    """One sample's outputs turned into text, kept token ids and logprobs, an ending, and its
    timings (for the server's metrics)."""

    def __init__(
        self,
        sample: int,
        generation: GenerationRequest,
        tokenizer: ModelTokenizer | None,
        stream: RequestStream,
        timer: RequestTimer,
        reasoning_parser: str | None = None,
    ) -> None:
        self.sample = sample
        self.generation = generation
        self.prompt_token_ids = generation.prompts[sample // generation.best_of]
        # A chat reply's <think> block, split out as it streams (server.reasoning_parser).
        self.reasoning: ReasoningSplitter | None = None
        chat = generation.endpoint in ("chat", "responses")
        if reasoning_parser is not None and chat and tokenizer is not None:
            tail = prompt_end(tokenizer, self.prompt_token_ids)
            self.reasoning = ReasoningSplitter(reasoning_parser, tail)
        tools = generation.tools
        self.tool_calls: ToolCallReader | None = None
        if tools is not None and tools.mode != "none":
            self.tool_calls = ToolCallReader(tools)
        self.sample_text = SampleText(
            tokenizer,
            generation.stop,
            include_stop=generation.include_stop_str_in_output,
            skip_special_tokens=generation.skip_special_tokens,
            stop_token_ids=generation.params.stop_token_ids,
        )
        self.stream = stream
        self.timer = timer
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.finish_reason: str | None = None
        self.error: RequestError | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def text(self) -> str:
        return self.sample_text.text

    @property
    def token_ids(self) -> list[int]:
        return self.sample_text.token_ids

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return self.sample_text.logprobs

    @property
    def cumulative_logprob(self) -> float:
        return sum(entry.logprob for entry in self.logprobs)

    def take(self, output: RequestOutput) -> Piece:
        """Account one output; returns what to send for it."""
        if output.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = list(output.prompt_logprobs)
        piece = self.sample_text.take(output)
        self.timer.tokens(len(piece.token_ids), time.monotonic())
        if self.sample_text.stopped:
            self.finish_reason = "stop"
        elif output.finished:
            self._end(output)
        return piece

    def _end(self, output: RequestOutput) -> None:
        reason = output.finish_reason or "error: no finish reason"
        if reason in ("stop", "length"):
            self.finish_reason = reason
            return
        where = f"request {output.request_id} on DP rank {output.dp_rank}"
        if reason == "prompt_length_exceeded":
            self.error = RequestError(
                f"{where}: the prompt does not fit the rank's limits (max_model_len, or "
                "max_num_batched_tokens without chunked prefill, or the KV pool)",
                param="prompt",
            )
        elif reason == "insufficient_system_resource":
            self.error = RequestError(
                f"{where} was preempted for lack of KV blocks "
                "(scheduler.stop_preempted_request is true); retry later",
                status=503,
                error_type="server_error",
            )
        else:
            detail = reason.removeprefix("error: ")
            kind = output.error_kind
            if kind is ErrorKind.INVALID_REQUEST:
                self.error = RequestError(f"{where} was refused: {detail}")
                return
            # The group failed or the server is going away: the service is unavailable; any
            # other error is this request's own.
            unavailable = kind in (ErrorKind.GROUP_FAILED, ErrorKind.ENGINE_STOPPED)
            self.error = RequestError(
                f"{where} failed: {detail}",
                status=503 if unavailable else 500,
                error_type="server_error",
            )

    def record_end(self) -> None:
        if self.finish_reason is not None:
            reason = self.finish_reason
        elif self.error is not None:
            reason = "error"
        else:
            reason = "abort"  # the client went away first
        self.timer.finish(reason, time.monotonic())


def usage(generation: GenerationRequest, choices: Sequence[Choice]) -> Usage:
    """Each prompt's tokens once, and every returned choice's tokens."""
    return Usage(
        sum(len(prompt) for prompt in generation.prompts),
        sum(len(choice.token_ids) for choice in choices),
    )


async def answer_whole(
    generation: GenerationRequest, choices: list[Choice], shape: ResponseShape
) -> web.Response:
    """Wait for every sample; the reply holds the `n` best of each prompt's samples."""

    async def collect(choice: Choice) -> None:
        while not choice.done:
            choice.take(await choice.stream.next())

    await asyncio.gather(*(collect(choice) for choice in choices))
    for choice in choices:
        if choice.error is not None:
            raise choice.error
    kept = _best(generation, choices)
    bodies = []
    for index, choice in enumerate(kept):
        text: str | None = _echo_text(generation, choice, shape) + choice.text
        reasoning = None
        if choice.reasoning is not None:
            split = choice.reasoning.feed(choice.text, final=True)
            text = split.content or None
            if generation.include_reasoning:
                reasoning = split.reasoning or None
        calls: list[ToolCall] = []
        if choice.tool_calls is not None:
            shown = choice.tool_calls.feed(text or "")
            rest, calls = choice.tool_calls.finish()
            text = (shown + rest) or None
        bodies.append(
            shape.choice(
                index,
                text,
                choice.token_ids,
                finish_reason(generation.tools, choice.finish_reason, calls),
                _logprobs_of(choice, shape),
                reasoning=reasoning,
                tool_calls=[call.body() for call in calls] or None,
            )
        )
    return web.json_response(shape.full(bodies, usage(generation, kept)))


def _best(generation: GenerationRequest, choices: list[Choice]) -> list[Choice]:
    if generation.best_of == generation.n:
        return choices
    kept = []
    for start in range(0, len(choices), generation.best_of):
        group = choices[start : start + generation.best_of]
        ranked = sorted(group, key=lambda c: (-c.cumulative_logprob, c.sample))
        kept += sorted(ranked[: generation.n], key=lambda c: c.sample)
    return kept


async def answer_stream(
    request: web.Request,
    generation: GenerationRequest,
    choices: list[Choice],
    shape: ResponseShape,
) -> web.StreamResponse:
    """Server-sent events: each choice's chunks as its tokens come, each choice's last chunk
    with its finish reason, then the usage (when asked) and [DONE]. An error ends the stream
    with an error event (the status line went out with the first byte)."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    events: asyncio.Queue[tuple[Choice, Piece | None]] = asyncio.Queue()

    async def feed(choice: Choice) -> None:
        while not choice.done:
            piece = choice.take(await choice.stream.next())
            await events.put((choice, piece))
        await events.put((choice, None))  # this choice is done

    async def only(choice: Choice) -> tuple[Choice, Piece | None]:
        """The next event of a stream of one choice, read in place: no feeder task and no
        queue hop per token (the common case, n = 1; every hop is interpreter time the engine
        thread waits for, docs/benchmark_notes.md, "Where a served step's time goes")."""
        if choice.done:
            return choice, None
        return choice, choice.take(await choice.stream.next())

    single = len(choices) == 1
    feeders = [] if single else [asyncio.ensure_future(feed(choice)) for choice in choices]
    # An echoed prompt opens its choice once the choice's first output has come (it carries
    # the prompt's logprobs); the choice's text offsets count the prompt's text.
    echoed: dict[int, int] = {}

    async def send(chunk: dict[str, Any]) -> None:
        await response.write(sse(_with_usage(generation, choices, chunk)))

    # Each chat choice opens with the assistant's role, sent with its first output as vLLM
    # sends it: clients time the first token by the first chunk that has a choice.
    opened: set[int] = set() if generation.endpoint == "chat" else {c.sample for c in choices}
    try:
        remaining = len(choices)
        while remaining:
            choice, piece = await (only(choices[0]) if single else events.get())
            if choice.sample not in opened:
                opened.add(choice.sample)
                await send(shape.chunk(choice.sample, "", [], first=True))
            if generation.echo and choice.sample not in echoed:
                opening = _echo_text(generation, choice, shape)
                echoed[choice.sample] = len(opening)
                logprobs = _prompt_logprobs_body(choice, shape)
                await send(shape.chunk(choice.sample, opening, [], logprobs=logprobs))
            if piece is None:
                remaining -= 1
                if choice.error is not None:
                    await response.write(sse(choice.error.body()))
                    break
                # What the readers held back (a possible tag's start; tool calls, whole).
                text, thought = split_piece(generation, choice, "", final=True)
                rest, calls = held_calls(choice)
                text += rest
                if text or thought or calls:
                    bodies = [call.body(index) for index, call in enumerate(calls)]
                    await send(
                        shape.chunk(
                            choice.sample, text, [], reasoning=thought, tool_calls=bodies or None
                        )
                    )
                reason = finish_reason(generation.tools, choice.finish_reason, calls)
                await send(shape.chunk(choice.sample, "", [], reason))
                continue
            # A chunk for every output that carries tokens, even when their text is held back
            # (a split character, a possible stop string): clients time tokens by chunks (vLLM's
            # benchmark counts each chunk as a token's arrival), and vLLM sends one per output.
            if piece.text or piece.token_ids:
                offset = echoed.get(choice.sample, 0) + _offset(choice, piece)
                logprobs = shape.logprobs(piece.token_ids, piece.logprobs, offset)
                text, thought = split_piece(generation, choice, piece.text)
                await send(
                    shape.chunk(
                        choice.sample, text, piece.token_ids, logprobs=logprobs, reasoning=thought
                    )
                )
        else:
            if generation.include_usage:
                await response.write(sse(shape.usage_chunk(usage(generation, choices))))
        await response.write(sse("[DONE]"))
        await response.write_eof()
    finally:
        for feeder in feeders:
            feeder.cancel()
    return response


def split_piece(
    generation: GenerationRequest, choice: Choice, text: str, *, final: bool = False
) -> tuple[str, str]:
    """(content, reasoning) of a piece of a choice's text: all content without a reasoning
    parser; the reasoning left out where the request set include_reasoning false; content
    that may be a tool call held back by the choice's tool-call reader."""
    content, reasoning = text, ""
    if choice.reasoning is not None:
        split = choice.reasoning.feed(text, final=final)
        content = split.content
        reasoning = split.reasoning if generation.include_reasoning else ""
    if choice.tool_calls is not None and content:
        content = choice.tool_calls.feed(content)
    return content, reasoning


def held_calls(choice: Choice) -> tuple[str, list[ToolCall]]:
    """(content the tool-call reader still held, the calls), once the choice ended."""
    if choice.tool_calls is None:
        return "", []
    return choice.tool_calls.finish()


def _with_usage(
    generation: GenerationRequest, choices: list[Choice], chunk: dict[str, Any]
) -> dict[str, Any]:
    if generation.continuous_usage:
        chunk["usage"] = usage(generation, choices).body()
    return chunk


def _echo_text(generation: GenerationRequest, choice: Choice, shape: ResponseShape) -> str:
    if not generation.echo:
        return ""
    return shape.decode(choice.prompt_token_ids)


def _offset(choice: Choice, piece: Piece) -> int:
    """Where ``piece``'s text starts in the choice's whole text (logprobs' text_offset)."""
    return len(choice.text) - len(piece.text)


def _logprobs_of(choice: Choice, shape: ResponseShape) -> dict[str, Any] | None:
    if choice.generation.logprobs is None:
        return None
    echo = _echo_text(choice.generation, choice, shape)
    body = shape.logprobs(choice.token_ids, choice.logprobs, len(echo))
    prompt = _prompt_logprobs_body(choice, shape) if echo else None
    if prompt is not None and body is not None:
        return shape.join_logprobs(prompt, body)
    return body


def _prompt_logprobs_body(choice: Choice, shape: ResponseShape) -> dict[str, Any] | None:
    """The echoed prompt's logprobs (its first token has none)."""
    if choice.generation.logprobs is None or choice.prompt_logprobs is None:
        return None
    return shape.logprobs(choice.prompt_token_ids, choice.prompt_logprobs, 0)
