"""A TCP proxy on loopback that makes a server's keep-alive timeout race deterministic.

``python stale_keepalive_proxy.py UPSTREAM_PORT``: listens on a free port (printed on the first
line of stdout) and forwards each connection to ``127.0.0.1:UPSTREAM_PORT``, until the client
sends bytes on a connection that has already carried an answer (the next request on a kept-alive
connection): then it closes the connection without forwarding them, as a server does whose
idle timeout fires while that request is on its way. Every request on a reused connection meets
that, whatever the timing; a request on a new connection goes through.
"""

from __future__ import annotations

import asyncio
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                answered: list[bool], upstream: bool) -> None:
    try:
        while data := await reader.read(65536):
            if not upstream and answered[0]:  # the next request on a kept-alive connection
                return
            if upstream:
                answered[0] = True
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        return


async def _connection(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter,
                      port: int) -> None:
    up_r, up_w = await asyncio.open_connection("127.0.0.1", port)
    answered = [False]
    tasks = [asyncio.create_task(_pipe(client_r, up_w, answered, upstream=False)),
             asyncio.create_task(_pipe(up_r, client_w, answered, upstream=True))]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for w in (client_w, up_w):
            w.close()


async def _main(port: int) -> None:
    server = await asyncio.start_server(lambda r, w: _connection(r, w, port), "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1])))
