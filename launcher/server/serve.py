"""`lockstep serve`: start the DP group, then serve it over HTTP until SIGTERM or Ctrl-C.

    lockstep serve [--config YAML] [--set key=value ...] [--launcher ray|local] [--dp-size N]
                   [--host 127.0.0.1] [--port 8000] [--api-key KEY]

Settings come from the YAML (the engine's sections and a `server:` section, see
server/config.py), then `--set` (server keys as `server.KEY`, or by their bare name), then the
flags. The API key may also come from $LOCKSTEP_API_KEY, which keeps it out of the process
list. With no --config the built-in job's engine settings are served, as `lockstep run` runs
them. Once the server listens it prints `lockstep serve: listening on http://HOST:PORT`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from dist_engine.log import get_logger
from launcher.server.config import SERVER_KEYS, ServerConfig

if TYPE_CHECKING:  # imported where used: `lockstep --help` must not pay for torch
    from dist_engine.engine.config import EngineConfig
    from launcher.clients import Client

log = get_logger()
API_KEY_ENV = "LOCKSTEP_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML engine config, optionally with a server: section")
    parser.add_argument("--launcher", choices=["ray", "local"])
    parser.add_argument("--dp-size", type=int)
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting"
    )
    parser.add_argument("--host", help="address to bind (default 127.0.0.1: this host only)")
    parser.add_argument("--port", type=int, help="port to listen on (default 8000; 0: any free)")
    parser.add_argument(
        "--api-key", help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})"
    )


def main(args: argparse.Namespace, builtin_config: Callable[[], EngineConfig]) -> int:
    """Run the server until a signal; ``builtin_config`` gives the built-in job's settings."""
    engine_config, server_config = load_configs(args, builtin_config)
    client = make_client(engine_config)
    try:
        from launcher.server.app import LockstepServer

        server = LockstepServer(client, engine_config, server_config)
    except BaseException:
        client.shutdown()
        raise
    asyncio.run(serve_until_signal(server))
    return 0


def load_configs(
    args: argparse.Namespace, builtin_config: Callable[[], EngineConfig]
) -> tuple[EngineConfig, ServerConfig]:
    server_values: dict[str, Any] = {}
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise ValueError(f"--config {args.config}: no such file")
        try:
            values = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise ValueError(f"{path}: not valid YAML: {error}") from None
        if not isinstance(values, dict):
            raise ValueError(f"{path}: the top level must be a mapping")
        server_values = values.pop("server", None) or {}
        if not isinstance(server_values, dict):
            raise ValueError(f"{path}: server must be a mapping, got {server_values!r}")
        from dist_engine.engine.config import EngineConfig

        engine = EngineConfig.from_dict(values)
    else:
        engine = builtin_config()
    engine_overrides: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set takes KEY=VALUE, got {item!r}")
        key = key.strip()
        name = key.removeprefix("server.")
        if key.startswith("server.") or name in SERVER_KEYS:
            server_values[name] = yaml.safe_load(value)
        else:
            engine_overrides[key] = yaml.safe_load(value)
    if args.launcher:
        engine_overrides["launcher"] = args.launcher
    if args.dp_size is not None:
        engine_overrides["dp_size"] = args.dp_size
    if engine_overrides:
        engine = engine.with_overrides(**engine_overrides)
    flags = {"host": args.host, "port": args.port, "api_key": args.api_key}
    server_values.update({k: v for k, v in flags.items() if v is not None})
    if "api_key" not in server_values and os.environ.get(API_KEY_ENV):
        server_values["api_key"] = os.environ[API_KEY_ENV]
    return engine, ServerConfig.from_dict(server_values)


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
    config = server.config
    log.info("serving %s: %s", server.limits.served_model_name, config.public())
    host = f"[{config.host}]" if ":" in config.host else config.host
    print(f"lockstep serve: listening on http://{host}:{port}", flush=True)
    await stop.wait()
    log.info("signal received: shutting down")
    await server.stop()
    print("lockstep serve: stopped", flush=True)
