"""An HTTP front of a ``kvoffload serve`` whose engine cannot serve: every POST is answered 503
with OpenAI's error JSON (as a server shutting down or whose engine failed answers), every GET
(health, models, metrics, event sources) is passed to the real server behind it.

``python unavailable_front.py UPSTREAM_PORT``: listens on a free loopback port, printed on the
first line of stdout.
"""

from __future__ import annotations

import asyncio
import socket
import sys

from aiohttp import ClientSession, web

_BODY = {"error": {"message": "the engine failed: RuntimeError('device lost')",
                   "type": "service_unavailable_error", "param": None, "code": None}}


async def main(upstream: int) -> None:
    session = ClientSession(f"http://127.0.0.1:{upstream}")

    async def get(request: web.Request) -> web.Response:
        async with session.get(request.path_qs) as resp:
            return web.Response(body=await resp.read(), status=resp.status,
                                content_type=resp.content_type)

    async def post(_: web.Request) -> web.Response:
        return web.json_response(_BODY, status=503)

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", get)
    app.router.add_route("POST", "/{tail:.*}", post)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    print(sock.getsockname()[1], flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
