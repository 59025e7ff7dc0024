"""`lockstep serve`: start the DP group, then serve it over HTTP until SIGTERM or Ctrl-C.

    lockstep serve [MODEL] [--config YAML] [--set KEY=VALUE ...] [settings flags]
    lockstep serve /path/to/model -dp 2 --max-model-len 4096 --served-model-name a b --port 0
    lockstep serve org/name --revision v1 -dp 2     # a hub id, through the hub's cache

Settings come from the YAML (the engine's sections and a `server:` section, see
server/config.py), then `--set` (server keys as `server.KEY`, or by their bare name), then the
flags: one per config key, vLLM's names among them (launcher/flags.py). The API key may also
come from $LOCKSTEP_API_KEY, which keeps it out of the process list. With neither MODEL nor
--config the built-in job's engine settings are served, as `lockstep run` runs them. Once the
server listens it prints `lockstep serve: listening on http://HOST:PORT`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dist_engine.log import get_logger
from launcher import flags
from launcher.server.config import ServerConfig

if TYPE_CHECKING:  # imported where used: `lockstep --help` must not pay for torch
    from dist_engine.engine.config import EngineConfig
    from launcher.clients import Client

log = get_logger()
API_KEY_ENV = "LOCKSTEP_API_KEY"
DESCRIPTION = """An OpenAI-compatible HTTP server in front of a DP group.

Settings: the YAML of --config (else MODEL with every default, else the built-in job), then
--set KEY=VALUE, then the flags below, each named after its config key. The API key may come
from $LOCKSTEP_API_KEY instead of --api-key."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_common_arguments(parser, server=True)


def main(args: argparse.Namespace, builtin_job: Callable[[], dict[str, Any]]) -> int:
    """Run the server until a signal; ``builtin_job`` gives the built-in job's settings."""
    engine_config, server_config = prepare_model(*load_configs(args, builtin_job))
    from launcher.llm import check_cuda_graphs, check_gpu_memory_utilization, group_loading

    check_gpu_memory_utilization(engine_config)
    check_cuda_graphs(engine_config)
    with group_loading(engine_config):
        client = make_client(engine_config)
    try:
        check_gpu_memory_utilization(engine_config, client)
        from launcher.server.app import LockstepServer

        server = LockstepServer(client, engine_config, server_config)
    except BaseException:
        client.shutdown()
        raise
    asyncio.run(serve_until_signal(server))
    return 0


def load_configs(
    args: argparse.Namespace, builtin_job: Callable[[], dict[str, Any]]
) -> tuple[EngineConfig, ServerConfig]:
    """The engine and server configs of a `serve` command line (config < --set < flags), with
    what can be checked without the model: the chat template compiles, a `tokenizer`
    directory holds a tokenizer."""
    engine, server_values = flags.load_settings(args, server=True, builtin=builtin_job)
    if "api_key" not in server_values and os.environ.get(API_KEY_ENV):
        server_values["api_key"] = os.environ[API_KEY_ENV]
    server = ServerConfig.from_dict(server_values)
    from launcher.server.tokenization import check_chat_template, check_tokenizer_dir

    template = server.chat_template_text()
    if template is not None:
        check_chat_template(template, "server.chat_template")
    if engine.tokenizer is not None:
        check_tokenizer_dir(engine.tokenizer, "tokenizer")
    return engine, server


def prepare_model(engine: EngineConfig, server: ServerConfig) -> tuple[EngineConfig, ServerConfig]:
    """The configs with the model made ready before any rank starts: a hub id resolved to its
    snapshot and pinned to its commit (the ranks get the directory; the served name defaults
    to the id, as vLLM's does), the checkpoint checked, its tokenizer and generation config
    found readable. Errors name what is missing."""
    from dist_engine.engine.engine import check_max_model_len
    from dist_engine.models.loader import check_checkpoint
    from launcher.generation_config import load_generation_defaults
    from launcher.server.tokenization import check_tokenizer_dir

    engine = engine.with_local_model()
    if engine.hub_id is not None and server.served_model_name is None:
        server = dataclasses.replace(server, served_model_name=(engine.hub_id,))
    check_max_model_len(engine.scheduler.max_model_len, check_checkpoint(engine.model))
    if engine.tokenizer is None:
        check_tokenizer_dir(engine.model, "model", required=False)
    load_generation_defaults(engine.generation_config, engine.model)
    return engine, server


def make_client(config: EngineConfig) -> Client:
    """Start the DP group the config describes (this takes the model load's time)."""
    launcher = config.parallel.launcher
    if launcher == "ray":
        from launcher.ray_launcher import RayClient

        return RayClient(config)
    if launcher == "local":
        from launcher.clients import LocalClient

        return LocalClient(config)
    raise ValueError(
        f"lockstep serve starts its group with parallel.launcher ray or local, got {launcher!r} "
        "(under torchrun every process is a rank, and none of them is a front end)"
    )


async def serve_until_signal(server: Any) -> None:
    """Serve until SIGTERM or SIGINT, then drain and stop."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        port = await server.start()
    except BaseException:
        await server.frontend.close()
        raise
    freeze_startup_heap()
    config = server.config
    log.info("serving %s: %s", list(server.limits.served_model_names), config.public())
    log.info("%s", server.limits.defaults.describe())
    host = f"[{config.host}]" if ":" in config.host else config.host
    print(f"lockstep serve: listening on http://{host}:{port}", flush=True)
    await stop.wait()
    log.info("signal received: shutting down")
    await server.stop()
    print("lockstep serve: stopped", flush=True)


def freeze_startup_heap() -> None:
    """Leave what start-up built (modules, the model's objects, the app: ~314,000 objects for
    the built-in model at DP=1) out of every later garbage collection, as vLLM's server does.

    A full collection scans every tracked object, and Python runs one each time enough
    objects have outlived two younger collections, which serving makes steadily (per-token
    outputs, stream state): on the AVX-512 host one came after 832 chat requests and took
    153 ms, a pause every open stream saw; over what serving itself keeps it takes under a
    millisecond (docs/benchmark_notes.md, "Garbage collection while serving"). What is frozen
    is never collected as part of a cycle later: the front end's own objects, at DP=1 the
    engine's, which live as long as the server, and under Ray the handles of a group a heal
    replaces (a few objects). Rank processes are not frozen: a heal replaces their engines'
    objects, tensors included; their full collections came during start-up only.
    """
    gc.collect()
    gc.freeze()
    log.info(
        "start-up heap frozen: %d objects left out of garbage collection", gc.get_freeze_count()
    )
