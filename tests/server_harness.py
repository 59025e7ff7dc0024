"""A `lockstep serve` server inside the test process, on a loopback port of its own.

The server's event loop runs on a thread, so tests drive it with blocking clients (the
official `openai` client, httpx) from the test's own thread. `stop()` drains and shuts the
group down, as SIGTERM does for `lockstep serve`.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from dist_engine.engine.config import EngineConfig
from launcher.server.app import LockstepServer
from launcher.server.config import ServerConfig
from launcher.server.serve import make_client


class ServerThread:
    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig) -> None:
        self.client = make_client(engine_config)
        try:
            self.server = LockstepServer(self.client, engine_config, server_config)
        except BaseException:
            self.client.shutdown()
            raise
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="test-server", daemon=True
        )
        self.thread.start()
        self.port = self.run(self.server.start())
        self.server_stopped = False  # a test may stop the server itself (then set this)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model(self) -> str:
        return self.server.limits.served_model_name

    def run(self, coroutine: Any, timeout_s: float = 120.0) -> Any:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def stats(self) -> list[Any]:
        """Every rank's stats, fresh (asked on this thread; the server's own are up to a
        second old)."""
        return self.client.stats()

    def stop(self, drain_timeout_s: float = 5.0) -> None:
        """Drain and stop the server (unless a test did), then end the loop's thread."""
        try:
            if not self.server_stopped:
                self.server_stopped = True
                self.run(self.server.stop(drain_timeout_s))
        finally:
            if self.thread.is_alive():
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(30)
                self.loop.close()
