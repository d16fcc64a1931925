"""uvicorn's server, shutting down in hf_spin's order: when shutdown begins (a signal, or `should_exit`)
the scheduler drains first (no new requests; running ones get `shutdown_grace_seconds` to finish, then
each is cancelled with a last event saying so), and only then does uvicorn wait for the open
connections, which by then are ending on their own."""

from __future__ import annotations

import uvicorn

# Seconds uvicorn (and an SSE stream) wait beyond the scheduler's grace before cutting connections:
# the scheduler's own cancellation, with its explanatory last event, should arrive first.
SHUTDOWN_MARGIN_SECONDS = 5.0


class Server(uvicorn.Server):
    def __init__(self, app, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info", **config):
        self.service = app.state.service
        grace = self.service.shutdown_grace_seconds
        super().__init__(
            uvicorn.Config(
                app,
                host=host,
                port=port,
                log_level=log_level,
                timeout_graceful_shutdown=grace + SHUTDOWN_MARGIN_SECONDS,
                **config,
            )
        )

    async def shutdown(self, sockets=None) -> None:
        self.service.scheduler.drain(self.service.shutdown_grace_seconds)
        await super().shutdown(sockets)
