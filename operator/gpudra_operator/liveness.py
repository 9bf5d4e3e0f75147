"""The operator's ``/healthz`` (the Deployment's startup, liveness and readiness probes), served
by the active replica and a standby alike.

kopf's own endpoint only exists while kopf runs, and a standby does not run it; a probe that
failed there would restart a healthy standby. Here a standby is healthy while its event loop
answers (the same test kopf's endpoint makes); the active replica once kopf has finished its
start-up, as kopf's endpoint reported it. The body says which role the replica has."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

log = logging.getLogger("gpudra.operator")


async def serve_health(port: int, state: Callable[[], tuple[bool, Mapping[str, Any]]]) -> web.AppRunner:
    """Serve ``GET /healthz`` on ``port``, every address (IPv4 and IPv6): 200 when ``state()``
    says healthy, else 503; its mapping as the JSON body. Stop it with ``runner.cleanup()``."""

    async def healthz(_: web.Request) -> web.Response:
        healthy, body = state()
        return web.json_response(dict(body), status=200 if healthy else 503)

    app = web.Application()
    app.add_routes([web.get("/healthz", healthz)])
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, None, port).start()
    log.info("serving /healthz on port %d", port)
    return runner
