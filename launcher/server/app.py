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
import importlib.metadata
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from dist_engine.engine.config import EngineConfig
from dist_engine.log import LOGGER_NAME, get_logger
from dist_engine.models.registry import load_config
from launcher.clients import Client, group_max_model_len
from launcher.generation_config import load_generation_defaults
from launcher.samples import grammar_tokenizer
from launcher.server.config import ServerConfig
from launcher.server.frontend import EngineFrontend, RequestStream, Unavailable
from launcher.server.generation import Choice, answer_stream, answer_whole
from launcher.server.http import (
    OneLineLogger,
    check_body_headers,
    check_origin,
    parse_json,
    read_body,
    set_server_header,
)
from launcher.server.metrics import RequestTimer, ServerMetrics, StatsLog
from launcher.server.protocol import (
    GenerationRequest,
    ModelLimits,
    RequestError,
    client_request_id,
    detokenize_body,
    error_body,
    parse_chat,
    parse_completion,
    tokenize_body,
)
from launcher.server.responses import ResponseShape
from launcher.server.responses_api import answer_responses, parse_responses
from launcher.server.tokenization import ModelTokenizer

log = get_logger()
# A child of lockstep's logger: its handler writes the lines; the name lets them be filtered.
_access_logger = logging.getLogger(f"{LOGGER_NAME}.access")
try:
    _VERSION = importlib.metadata.version("lockstep")
except importlib.metadata.PackageNotFoundError:  # run from a source tree without installing
    _VERSION = "unknown"
_SHUTDOWN_GRACE_S = 5.0  # after the drain: how long handlers get to write their last bytes
# Threads that parse bodies, render chat templates and tokenize, off the event loop; requests
# reach them only once admitted (server.max_pending_requests), so their queue is bounded.
_PREPARE_WORKERS = 2
_ACCESS_LOG_TARGET_CHARS = 200


class LockstepServer:
    def __init__(self, client: Client, engine_config: EngineConfig, config: ServerConfig) -> None:
        self.config = config
        model_dir = engine_config.model
        names = config.served_model_name or (Path(model_dir).resolve().name,)
        name = names[0]
        tokenizer_dir = engine_config.tokenizer or model_dir
        model_config = load_config(model_dir)
        self.limits = ModelLimits(
            served_model_name=name,
            max_model_len=group_max_model_len(client, engine_config),
            vocab_size=model_config.vocab_size,
            num_ranks=client.num_ranks,
            tokenizer=ModelTokenizer.load(tokenizer_dir, chat_template=config.chat_template_text()),
            strict_requests=config.strict_requests,
            enable_auto_tool_choice=config.enable_auto_tool_choice,
            tool_call_parser=config.tool_call_parser,
            reasoning_parser=config.reasoning_parser,
            other_model_names=names[1:],
            defaults=load_generation_defaults(engine_config.generation_config, model_dir),
            grammar_tokenizer=grammar_tokenizer(tokenizer_dir, model_config),
        )
        self.metrics = ServerMetrics(name, client.num_ranks, self.limits.max_model_len)
        stats_log = None
        if config.stats_log_interval_s > 0:
            stats_log = StatsLog(self.metrics, config.stats_log_interval_s, time.monotonic())
        parallel = engine_config.parallel
        self.frontend = EngineFrontend(
            client,
            routing=config.routing,
            max_pending_requests=config.max_pending_requests,
            on_stats=stats_log.observe if stats_log is not None else None,
            on_rank_failure=parallel.on_rank_failure,
            max_recoveries_per_hour=parallel.max_recoveries_per_hour,
            poison_failure_threshold=parallel.poison_failure_threshold,
            job_seed=engine_config.seed,
            heal_metrics=self.metrics,
        )
        self.created = int(time.time())
        self.port: int | None = None
        self._runner: web.AppRunner | None = None
        self.app = web.Application(
            middlewares=[self._middleware], client_max_size=config.max_body_bytes
        )
        self._prepare_pool = ThreadPoolExecutor(_PREPARE_WORKERS, "lockstep-prepare")
        self._warned_fields: set[str] = set()
        expect = self._expect_continue
        self.app.router.add_post("/v1/completions", self._completions, expect_handler=expect)
        self.app.router.add_post("/v1/chat/completions", self._chat, expect_handler=expect)
        self.app.router.add_post("/v1/responses", self._responses, expect_handler=expect)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_post("/tokenize", self._tokenize, expect_handler=expect)
        self.app.router.add_post("/detokenize", self._detokenize, expect_handler=expect)
        self.app.router.add_get("/version", self._version)
        self.app.router.add_get("/health", self._health)
        # SageMaker's contract, as vLLM serves it: /ping is /health; /invocations takes a
        # chat body (it has "messages") or a completions body, and wants the API key.
        self.app.router.add_get("/ping", self._health)
        self.app.router.add_post("/ping", self._health)
        self.app.router.add_post("/invocations", self._invocations, expect_handler=expect)
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
        start = time.monotonic()
        try:
            check_origin(request, self.config.host)
            # As in vLLM, the key guards the API only: probes and scrapers need no secret.
            if self.config.api_key is not None and _guarded(request.path):
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
            self._responded(request, status, start)

    def _responded(self, request: web.Request, status: int, start: float) -> None:
        self.metrics.response(request.path, status)
        if self.config.access_log:
            # The raw target, escaped and cut: a path is the client's text, and must not
            # forge log lines or fill the log.
            target = request.raw_path.encode("unicode_escape").decode("ascii")
            if len(target) > _ACCESS_LOG_TARGET_CHARS:
                target = target[:_ACCESS_LOG_TARGET_CHARS] + "..."
            version = request.version
            _access_logger.info(
                '%s "%s %s HTTP/%d.%d" %d %.3fs', request.remote, request.method, target,
                version.major, version.minor, status, time.monotonic() - start,
            )  # fmt: skip

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
            self._responded(request, error.status, time.monotonic())
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

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_responses, "resp_")

    async def _invocations(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_invocation, "")

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
        """200 while the group serves ("ok") or heals ("degraded": requests wait for the new
        group), 503 once it failed or while draining ("unhealthy")."""
        status, reason = self.frontend.health()
        body = {"status": status, "reason": reason}
        return web.json_response(body, status=503 if status == "unhealthy" else 200)

    async def _metrics(self, request: web.Request) -> web.Response:
        stats = await self.frontend.stats()
        status, _ = self.frontend.health()
        body = self.metrics.render(stats, self.frontend.num_open, status != "unhealthy")
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
            self._warn_ignored(generation.ignored_fields)
            prefix = prefix or ("chatcmpl-" if generation.endpoint == "chat" else "cmpl-")
            request_id = f"{prefix}{uuid.uuid4().hex}"
            # The reply is named as vLLM names it: by the client's id where it gave one.
            given = client_request_id(request.headers.get("X-Request-Id"))
            given = given or generation.client_request_id
            streams = self._open_samples(request_id, generation)
        shape = ResponseShape(
            f"{prefix}{given}" if given else request_id, generation.model, generation.endpoint,
            generation.return_token_ids, self.limits.tokenizer,
        )  # fmt: skip
        choices = [
            Choice(sample, generation, self.limits.tokenizer, stream,
                   RequestTimer(self.metrics, stream.rank, arrival,
                                len(generation.prompts[sample // generation.best_of]),
                                generation.params.max_tokens),
                   self.config.reasoning_parser)
            for sample, stream in enumerate(streams)
        ]  # fmt: skip
        try:
            if generation.endpoint == "responses":
                return await answer_responses(request, generation, choices[0], shape.request_id)
            if generation.stream:
                return await answer_stream(request, generation, choices, shape)
            return await answer_whole(generation, choices, shape)
        finally:
            for choice in choices:
                choice.stream.abort()  # no-op if the rank already ended it
                choice.record_end()

    def _open_samples(self, request_id: str, generation: GenerationRequest) -> list[RequestStream]:
        """One request on a rank per sample; if one cannot open, the others are aborted. The
        samples of one prompt go to one rank under one group key, so that it computes the
        prompt once and they share its KV blocks (scheduler/samples.py)."""
        streams: list[RequestStream] = []
        best_of = generation.best_of
        try:
            for sample in range(generation.num_samples):
                prompt_index, index = divmod(sample, best_of)
                prompt = generation.prompts[prompt_index]
                name = request_id if generation.num_samples == 1 else f"{request_id}-{sample}"
                group = f"{request_id}/{prompt_index}" if best_of > 1 else None
                pin = streams[sample - index].rank if index else generation.dp_rank
                streams.append(
                    self.frontend.open_request(
                        name, prompt, generation.sample_params(sample), pin, group
                    )
                )
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams

    def _warn_ignored(self, fields: tuple[str, ...]) -> None:
        """One warning per unknown field name over the server's life (vLLM's policy)."""
        new = [name for name in fields if name not in self._warned_fields]
        if new:
            self._warned_fields.update(new)
            log.warning(
                "ignoring unknown request field(s) %s (set server.strict_requests to refuse "
                "them); this is said once per field",
                new,
            )

    # -- tokenizer endpoints ----------------------------------------------------------------
    async def _tokenize(self, request: web.Request) -> web.Response:
        raw = await read_body(request, self.config.max_body_bytes, self.config.read_timeout_s)
        body = parse_json(raw)
        tokenizer = self._tokenizer_or_error()
        loop = asyncio.get_running_loop()
        tokens = await loop.run_in_executor(self._prepare_pool, tokenize_body, body, self.limits)
        reply: dict[str, Any] = {
            "count": len(tokens),
            "max_model_len": self.limits.max_model_len,
            "tokens": tokens,
        }
        if body.get("return_token_strs"):
            reply["token_strs"] = [tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
        return web.json_response(reply)

    async def _detokenize(self, request: web.Request) -> web.Response:
        raw = await read_body(request, self.config.max_body_bytes, self.config.read_timeout_s)
        body = parse_json(raw)
        tokenizer = self._tokenizer_or_error()
        tokens = detokenize_body(body, self.limits)
        return web.json_response({"prompt": tokenizer.decode(tokens)})

    def _tokenizer_or_error(self) -> ModelTokenizer:
        if self.limits.tokenizer is None:
            raise RequestError("this model has no tokenizer", status=404)
        return self.limits.tokenizer

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": _VERSION})


def _guarded(path: str) -> bool:
    """The paths the API key guards: the API, and SageMaker's way into it. Probes, scrapers
    and /tokenize need no secret, as in vLLM."""
    return path.startswith("/v1/") or path == "/invocations"


def parse_invocation(body: Any, limits: ModelLimits) -> GenerationRequest:
    """SageMaker's /invocations: a chat body if it has "messages", else a completions body."""
    if isinstance(body, dict) and "messages" in body:
        return parse_chat(body, limits)
    return parse_completion(body, limits)


def _prepare(raw: bytes, parse: Any, limits: ModelLimits) -> GenerationRequest:
    """On a prepare thread: the body parsed, validated, rendered and tokenized."""
    return parse(parse_json(raw), limits)


def _json_error(error: RequestError) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else {}
    return web.json_response(error.body(), status=error.status, headers=headers)
