"""The HTTP server: OpenAI's endpoints over an `EngineFrontend`, on aiohttp.

    POST /v1/completions, /v1/chat/completions   (stream: true -> server-sent events)
    GET  /v1/models, /health, /metrics

A request is validated (protocol.py), opened on a rank (frontend.py), and its outputs turned
into text as they come (`_Reply`); whether the client streams only decides how the text is
sent. Whatever ends the handler early (the client hangs up, a stop string matched, an error)
aborts the request on its rank, so its KV blocks are freed at the rank's next step. Clients
that hang up are noticed without writing to them: the runner cancels the handler of a closed
connection (`handler_cancellation`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from dist_engine.engine.config import EngineConfig
from dist_engine.engine.outputs import ErrorKind, RequestOutput
from dist_engine.log import get_logger
from dist_engine.models.registry import load_config
from launcher.clients import Client
from launcher.generation_config import load_generation_defaults
from launcher.server.config import ServerConfig
from launcher.server.frontend import EngineFrontend, RequestStream, Unavailable
from launcher.server.http import (
    OneLineLogger,
    check_body_headers,
    check_origin,
    parse_json,
    read_body,
    set_server_header,
)
from launcher.server.metrics import ServerMetrics
from launcher.server.protocol import (
    GenerationRequest,
    ModelLimits,
    RequestError,
    error_body,
    parse_chat,
    parse_completion,
)
from launcher.server.responses import ResponseShape, Usage, sse
from launcher.server.tokenization import IncrementalDetokenizer, ModelTokenizer

log = get_logger()
_SHUTDOWN_GRACE_S = 5.0  # after the drain: how long handlers get to write their last bytes
# Threads that parse bodies, render chat templates and tokenize, off the event loop; requests
# reach them only once admitted (server.max_pending_requests), so their queue is bounded.
_PREPARE_WORKERS = 2


class LockstepServer:
    def __init__(self, client: Client, engine_config: EngineConfig, config: ServerConfig) -> None:
        self.config = config
        model_dir = engine_config.model
        names = config.served_model_name or (Path(model_dir).resolve().name,)
        name = names[0]
        tokenizer_dir = engine_config.tokenizer or model_dir
        self.limits = ModelLimits(
            served_model_name=name,
            max_model_len=engine_config.scheduler.max_model_len,
            vocab_size=load_config(model_dir).vocab_size,
            num_ranks=client.num_ranks,
            tokenizer=ModelTokenizer.load(tokenizer_dir, chat_template=config.chat_template_text()),
            other_model_names=names[1:],
            defaults=load_generation_defaults(engine_config.generation_config, model_dir),
        )
        self.frontend = EngineFrontend(
            client, routing=config.routing, max_pending_requests=config.max_pending_requests
        )
        self.metrics = ServerMetrics(name)
        self.created = int(time.time())
        self.port: int | None = None
        self._runner: web.AppRunner | None = None
        self.app = web.Application(
            middlewares=[self._middleware], client_max_size=config.max_body_bytes
        )
        self._prepare_pool = ThreadPoolExecutor(_PREPARE_WORKERS, "lockstep-prepare")
        expect = self._expect_continue
        self.app.router.add_post("/v1/completions", self._completions, expect_handler=expect)
        self.app.router.add_post("/v1/chat/completions", self._chat, expect_handler=expect)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/metrics", self._metrics)
        self.app.on_response_prepare.append(set_server_header)

    # -- lifetime ---------------------------------------------------------------------------
    async def start(self) -> int:
        """Start serving; returns the port (the one the OS chose if the config says 0)."""
        self.frontend.start()
        runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=_SHUTDOWN_GRACE_S,
            # Also the time a new connection has to send its first request's headers.
            keepalive_timeout=self.config.keepalive_timeout_s,
            logger=OneLineLogger(logging.getLogger("aiohttp.server"), {}),
        )
        await runner.setup()
        self._runner = runner
        await web.TCPSite(runner, self.config.host, self.config.port).start()
        self.port = runner.addresses[0][1]
        return self.port

    async def stop(self, drain_timeout_s: float | None = None) -> None:
        """Drain (no new requests; open ones finish, or end with an error past the timeout),
        close the listener, then shut the DP group down."""
        timeout = self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        log.info("draining %d open request(s), up to %.0f s", self.frontend.num_open, timeout)
        ended = await self.frontend.drain(timeout)
        if ended:
            log.warning("the drain timed out: %d request(s) ended with an error", ended)
        if self._runner is not None:
            await self._runner.cleanup()
        await self.frontend.close()
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)

    # -- middleware: authorization, errors as OpenAI JSON, response counts ------------------
    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        status = 500
        try:
            check_origin(request, self.config.host)
            if self.config.api_key is not None and request.path != "/health":
                self._authorize(request)
            response = await handler(request)
            status = response.status
            return response
        except RequestError as error:
            status = error.status
            return _json_error(error)
        except Unavailable as error:
            status = 503
            headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s else {}
            return web.json_response(
                error_body(str(error), "server_error"), status=503, headers=headers
            )
        except web.HTTPException as error:  # unknown path, wrong method, ...
            status = error.status
            message = f"{error.reason}: {request.method} {request.path}"
            return web.json_response(
                error_body(message, "invalid_request_error"),
                status=error.status,
                headers={k: v for k, v in error.headers.items() if k == "Allow"},
            )
        except (asyncio.CancelledError, ConnectionResetError):
            status = 499  # the client went away (nginx's code for it)
            raise
        except Exception as error:
            log.exception("%s %s failed", request.method, request.path)
            return web.json_response(
                error_body(f"internal error: {type(error).__name__}", "server_error"),
                status=500,
            )
        finally:
            self.metrics.response(request.path, status)

    def _authorize(self, request: web.Request) -> None:
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise RequestError(
                "missing API key: send the header 'Authorization: Bearer KEY'",
                status=401,
                code="invalid_api_key",
            )
        assert self.config.api_key is not None
        # aiohttp decodes header bytes that are not UTF-8 to lone surrogates; keep them as
        # bytes, which can only fail to match.
        sent = key.strip().encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(sent, self.config.api_key.encode()):
            raise RequestError("incorrect API key", status=401, code="invalid_api_key")

    async def _expect_continue(self, request: web.Request) -> web.StreamResponse | None:
        """`Expect: 100-continue`: the checks a body would fail run before the client is told
        to send it."""
        try:
            check_origin(request, self.config.host)
            if self.config.api_key is not None:
                self._authorize(request)
            check_body_headers(request, self.config.max_body_bytes)
        except RequestError as error:
            self.metrics.response(request.path, error.status)
            response = _json_error(error)
            response.force_close()  # the client may send the body anyway: don't read it
            return response
        expect = request.headers.get("Expect", "")
        if expect.lower() != "100-continue":
            return web.json_response(
                error_body("only 'Expect: 100-continue' is understood", "invalid_request_error"),
                status=417,
            )
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # what follows is the reply's first byte
        return None

    # -- endpoints --------------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion, "cmpl-")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat, "chatcmpl-")

    async def _models(self, request: web.Request) -> web.Response:
        models = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "lockstep",
                "max_model_len": self.limits.max_model_len,
            }
            for name in self.limits.served_model_names
        ]
        return web.json_response({"object": "list", "data": models})

    async def _health(self, request: web.Request) -> web.Response:
        healthy, reason = self.frontend.health()
        body = {"status": "ok" if healthy else "unhealthy", "reason": reason}
        return web.json_response(body, status=200 if healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        stats = await self.frontend.stats()
        healthy, _ = self.frontend.health()
        body = self.metrics.render(stats, self.frontend.num_open, healthy)
        response = web.Response(body=body)
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    # -- generation -------------------------------------------------------------------------
    async def _generate(self, request: web.Request, parse: Any, prefix: str) -> web.StreamResponse:
        arrival = time.monotonic()
        # Admitted first: a server at its limit refuses before reading or tokenizing anything.
        with self.frontend.admission():
            raw = await read_body(request, self.config.max_body_bytes, self.config.read_timeout_s)
            loop = asyncio.get_running_loop()
            generation: GenerationRequest = await loop.run_in_executor(
                self._prepare_pool, _prepare, raw, parse, self.limits
            )
            request_id = f"{prefix}{uuid.uuid4().hex}"
            stream = self.frontend.open_request(
                request_id, generation.prompt_token_ids, generation.params, generation.dp_rank
            )
        self.metrics.prompt_tokens.labels(self.limits.served_model_name).inc(
            len(generation.prompt_token_ids)
        )
        shape = ResponseShape(
            request_id, generation.model, generation.endpoint,
            generation.return_token_ids,
        )  # fmt: skip
        reply = _Reply(generation, self.limits.tokenizer, self.metrics, stream, arrival)
        try:
            if generation.stream:
                return await self._send_stream(request, generation, stream, shape, reply)
            return await self._send_whole(generation, stream, shape, reply)
        finally:
            stream.abort()  # no-op if the rank already ended it
            reply.record_end()

    async def _send_whole(
        self, generation: GenerationRequest, stream: RequestStream, shape: ResponseShape,
        reply: _Reply,
    ) -> web.Response:  # fmt: skip
        while not reply.done:
            reply.take(await stream.next())
        if reply.error is not None:
            raise reply.error
        assert reply.finish_reason is not None
        body = shape.full(reply.text, reply.token_ids, reply.finish_reason, reply.usage)
        return web.json_response(body)

    async def _send_stream(
        self, request: web.Request, generation: GenerationRequest, stream: RequestStream,
        shape: ResponseShape, reply: _Reply,
    ) -> web.StreamResponse:  # fmt: skip
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        if generation.endpoint == "chat":
            await response.write(sse(shape.chunk("", [], first=True)))
        while not reply.done:
            text, tokens = reply.take(await stream.next())
            # Tokens whose text is held back (a split character, a possible stop string) send
            # nothing, unless the client asked for token ids.
            if text or (tokens and generation.return_token_ids):
                await response.write(sse(shape.chunk(text, tokens)))
        if reply.error is not None:
            # The status line went out with the first byte; the error travels as an event,
            # which the openai client raises as an APIError.
            await response.write(sse(reply.error.body()))
        else:
            await response.write(sse(shape.chunk("", [], reply.finish_reason)))
            if generation.include_usage:
                await response.write(sse(shape.usage_chunk(reply.usage)))
        await response.write(sse("[DONE]"))
        await response.write_eof()
        return response


class _Reply:
    """One request's outputs turned into text, kept token ids, an ending, and its timings."""

    def __init__(
        self,
        generation: GenerationRequest,
        tokenizer: ModelTokenizer | None,
        metrics: ServerMetrics,
        stream: RequestStream,
        arrival: float,
    ) -> None:
        self.generation = generation
        self.detokenizer = IncrementalDetokenizer(tokenizer, generation.stop)
        self.stop_token_ids = generation.params.stop_token_ids
        self.metrics = metrics
        self.model = metrics.model_name
        self.stream = stream
        self.arrival = arrival
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: RequestError | None = None
        self._last_token_time: float | None = None
        self._recorded = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def text(self) -> str:
        return self.detokenizer.text

    @property
    def usage(self) -> Usage:
        return Usage(len(self.generation.prompt_token_ids), len(self.token_ids))

    def take(self, output: RequestOutput) -> tuple[str, list[int]]:
        """Account one output; returns the text and token ids to send for it."""
        tokens = list(output.new_token_ids)
        text_tokens = tokens
        if output.finish_reason == "stop" and tokens and tokens[-1] in self.stop_token_ids:
            text_tokens = tokens[:-1]  # an EOS or stop token ends the text; it is not part of it
        before = len(self.detokenizer.token_ids)
        delta = self.detokenizer.add(text_tokens, finished=output.finished)
        kept = tokens[: len(self.detokenizer.token_ids) - before] if delta.stopped else tokens
        self._time(len(kept))
        self.token_ids += kept
        if delta.stopped:
            self.finish_reason = "stop"
        elif output.finished:
            self._end(output)
        return delta.text, kept

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

    def _time(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        now = time.monotonic()
        self.metrics.generation_tokens.labels(self.model).inc(num_tokens)
        if self._last_token_time is None:
            self.metrics.time_to_first_token.labels(self.model).observe(now - self.arrival)
            num_gaps, gap = num_tokens - 1, 0.0
        else:
            num_gaps, gap = num_tokens, (now - self._last_token_time) / num_tokens
        for _ in range(num_gaps):
            self.metrics.inter_token_latency.labels(self.model).observe(gap)
        self._last_token_time = now

    def record_end(self) -> None:
        if self._recorded:
            return
        self._recorded = True
        if self.finish_reason is not None:
            reason = self.finish_reason
        elif self.error is not None:
            reason = "error"
        else:
            reason = "abort"  # the client went away first
        self.metrics.e2e_latency.labels(self.model).observe(time.monotonic() - self.arrival)
        self.metrics.requests_finished.labels(self.model, self.generation.endpoint, reason).inc()


def _prepare(raw: bytes, parse: Any, limits: ModelLimits) -> GenerationRequest:
    """On a prepare thread: the body parsed, validated, rendered and tokenized."""
    return parse(parse_json(raw), limits)


def _json_error(error: RequestError) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else {}
    return web.json_response(error.body(), status=error.status, headers=headers)
