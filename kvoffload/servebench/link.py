"""A bandwidth-limited TCP link on loopback: it simulates the network between an instance and a
remote tier (``bench serve --compare-routing-redis-link``).

``python -m kvoffload.servebench.link UPSTREAM_PORT MB_PER_S N``: N links to
``127.0.0.1:UPSTREAM_PORT``, one listening port each (printed on one line of stdout, space
separated), each carrying at most ``MB_PER_S`` (10^6 bytes per second) in each direction over
all of its connections, as one host's network interface does. Bytes go out in the order they
came in, each chunk once the link has carried the earlier ones (a chunk of n bytes holds the link
n / rate seconds); no latency is added beyond that. It runs until killed.
"""

from __future__ import annotations

import asyncio
import functools
import sys

__all__ = ["Link"]

_CHUNK = 64 * 1024


class Link:
    """One direction of a link: ``rate`` bytes per second shared by every connection on it."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._free_at = 0.0  # when the link has carried every chunk accepted so far

    async def carry(self, size: int) -> None:
        """Wait until a chunk of ``size`` bytes, queued after the earlier ones, has crossed."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._free_at = max(self._free_at, now) + size / self.rate
        if self._free_at > now:
            await asyncio.sleep(self._free_at - now)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link) -> None:
    try:
        while data := await reader.read(_CHUNK):
            await link.carry(len(data))
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def _connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      upstream: int, up: Link, down: Link) -> None:
    try:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream)
    except OSError:
        writer.close()
        return
    await asyncio.gather(_pipe(reader, up_writer, up), _pipe(up_reader, writer, down))


async def _main(upstream: int, mb_per_s: float, links: int) -> None:
    servers = []
    for _ in range(links):
        up, down = Link(mb_per_s * 1e6), Link(mb_per_s * 1e6)
        connection = functools.partial(_connection, upstream=upstream, up=up, down=down)
        servers.append(await asyncio.start_server(connection, "127.0.0.1", 0))
    print(" ".join(str(s.sockets[0].getsockname()[1]) for s in servers), flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])))
