"""A loopback TCP proxy that tests and benches cut: what a network partition, or a connection
dropped without a word, looks like to one client of the API server (TLS passes through untouched;
the serving certificate names 127.0.0.1)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass(eq=False)
class _Link:
    """One client connection; a dead one is read and never answered, and never closed."""

    dead: bool = False


class TcpProxy:
    """Forwards connections on a free loopback port to ``upstream``.

    ``partition()`` stops every byte both ways and leaves new connections hanging, as a network
    that drops packets does: the client's requests neither fail nor get an answer. ``close()``
    drops everything.

    ``black_hole()`` is a load balancer or NAT that forgot its connections: every open connection
    goes silent for good (what the client sends is swallowed, nothing comes back, not even a
    close), and new ones are accepted and never answered. ``restore()`` forwards new connections
    again; those that went silent stay silent, as they do behind a load balancer, so only a client
    that gives up on them (a deadline) recovers."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._open = asyncio.Event()
        self._open.set()
        self._black_hole = False
        self._links: set[_Link] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def partition(self) -> None:
        self._open.clear()

    def black_hole(self) -> None:
        self._black_hole = True
        for link in self._links:
            link.dead = True

    def restore(self) -> None:
        self._black_hole = False

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        self._open.set()  # the held bytes now go nowhere: every connection is gone

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        link = _Link(dead=self._black_hole)
        self._links.add(link)
        self._writers.add(client_writer)
        await self._open.wait()
        if link.dead:
            await self._swallow(client_reader)
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_writer.transport.abort()
            return
        self._writers.add(upstream_writer)
        await asyncio.gather(self._pipe(client_reader, upstream_writer, link),
                             self._pipe(upstream_reader, client_writer, link), return_exceptions=True)
        for writer in (upstream_writer, *(() if link.dead else (client_writer,))):
            writer.transport.abort()
            self._writers.discard(writer)
        self._links.discard(link)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Link) -> None:
        while data := await reader.read(65536):
            await self._open.wait()  # partitioned: hold the bytes, read no more
            if link.dead:
                continue  # black hole: read and drop
            writer.write(data)
            await writer.drain()
        if not link.dead:  # a dead link tells the client nothing, not even that the server closed
            writer.transport.abort()

    @staticmethod
    async def _swallow(reader: asyncio.StreamReader) -> None:
        while await reader.read(65536):
            pass
