"""A loopback TCP proxy that tests and benches cut: what a network partition looks like to one
client of the API server (TLS passes through untouched; the serving certificate names 127.0.0.1)."""

from __future__ import annotations

import asyncio


class TcpProxy:
    """Forwards connections on a free loopback port to ``upstream``. ``partition()`` stops every
    byte both ways and leaves new connections hanging, as a network that drops packets does: the
    client's requests neither fail nor get an answer. ``close()`` drops everything."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._open = asyncio.Event()
        self._open.set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def partition(self) -> None:
        self._open.clear()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        self._open.set()  # the held bytes now go nowhere: every connection is gone

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self._writers.add(client_writer)
        await self._open.wait()
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_writer.transport.abort()
            return
        self._writers.add(upstream_writer)
        await asyncio.gather(self._pipe(client_reader, upstream_writer), self._pipe(upstream_reader, client_writer),
                             return_exceptions=True)
        for writer in (client_writer, upstream_writer):
            writer.transport.abort()
            self._writers.discard(writer)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            await self._open.wait()  # partitioned: hold the bytes, read no more
            writer.write(data)
            await writer.drain()
        writer.transport.abort()
