"""An HTTP front of a ``kvoffload serve`` that fails in one chosen way, deterministically.

``python faulty_front.py MODE UPSTREAM_PORT``: listens on a free loopback port (printed on the
first line of stdout); GETs (health, models, event sources, metrics) go to the real server
behind it, except as the mode says:

* ``hold``: a POST goes to the server; of a streamed answer, the first chunk is relayed, then
  nothing more, ever (a backend that stalls mid-stream while its health checks pass).
* ``malformed``: a POST is answered with a status line and a ``Content-Length`` that are not
  HTTP (the client's parser rejects it: aiohttp raises ``ClientResponseError``).
* ``bad-metrics``: ``/metrics`` answers text that is not Prometheus' format; POSTs go to the
  server.
"""

from __future__ import annotations

import asyncio
import socket
import sys

from aiohttp import ClientSession, web

_MALFORMED = b"HTTP/1.1 200 OK\r\nContent-Length: nonsense\r\n\r\n{}"
MODES = ("hold", "malformed", "bad-metrics")


async def main(mode: str, upstream: int) -> None:
    session = ClientSession(f"http://127.0.0.1:{upstream}")

    async def get(request: web.Request) -> web.Response:
        if mode == "bad-metrics" and request.path == "/metrics":
            return web.Response(text="garbage{{{\n")
        async with session.get(request.path_qs) as resp:
            return web.Response(body=await resp.read(), status=resp.status,
                                content_type=resp.content_type)

    async def post(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if mode == "malformed":
            if request.transport is not None:
                request.transport.write(_MALFORMED)
                request.transport.close()
            return web.Response()  # never sent: the connection is closed
        async with session.post(request.path_qs, data=body,
                                headers={"Content-Type": "application/json"}) as resp:
            if mode == "bad-metrics" or resp.content_type != "text/event-stream":
                return web.Response(body=await resp.read(), status=resp.status,
                                    content_type=resp.content_type)
            out = web.StreamResponse(status=resp.status)
            out.content_type = resp.content_type
            await out.prepare(request)
            await out.write(await resp.content.readany())
            await asyncio.Event().wait()  # hold: nothing more, ever
            return out

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
    if len(sys.argv) != 3 or sys.argv[1] not in MODES:
        sys.exit(f"usage: faulty_front.py {{{'|'.join(MODES)}}} UPSTREAM_PORT")
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
