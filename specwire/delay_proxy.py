"""A user-space TCP proxy that makes loopback look like a long link: one-way delay, jitter, bandwidth.

It needs neither root nor the kernel's `tc netem`, so cross-host latency can be emulated on any
machine: the proxy sits between the orchestrator and a model service, and every chunk of bytes
read from one side is written to the other side no earlier than

    release = max(tx_end + max(0, delay + U(−jitter, +jitter)), previous release)
    tx_end  = max(arrival, link free) + bytes · 8 / bandwidth

per direction: a FIFO link with a serialization delay (the bandwidth cap, a token bucket of one
packet) followed by a propagation delay. The `max` with the previous release keeps the byte
stream in order, so jitter delays a chunk but never reorders bytes within a connection. Reading
does not wait for writing, so a long delay pipelines like a real link rather than stop-and-wait.
The proxy only moves bytes, so HTTP/2 (gRPC) works through it unchanged.

Timers run on the asyncio loop, whose epoll timeout has millisecond resolution: a release can be
late by up to about a millisecond, never early.

    python -m specwire.delay_proxy --listen 127.0.0.1:P --upstream 127.0.0.1:Q --delay-ms 5

prints `READY proxy HOST:PORT` once listening (port 0 picks a free one).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field

from specwire.lifeline import watch_parent

CHUNK_BYTES = 64 * 1024
# Chunks read but not yet written, per direction of a connection, before reading pauses.
MAX_QUEUED_CHUNKS = 1024


@dataclass(frozen=True)
class LinkConfig:
    """One direction of an emulated link."""

    delay_ms: float = 0.0  # one-way propagation delay
    jitter_ms: float = 0.0  # each chunk's delay is delay ± U(jitter), clamped at 0
    bandwidth_mbps: float = 0.0  # serialization rate in 10^6 bits/s; 0 = unlimited

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.bandwidth_mbps < 0:
            raise ValueError(f"delay, jitter and bandwidth must be ≥ 0, got {self}")


@dataclass
class LinkClock:
    """When the chunks of one direction may be released: the rule in the module docstring.

    `free_at` is shared by every connection through the same proxy direction (they share the
    link's bandwidth); `last_release` is per connection (ordering holds within a stream).
    """

    config: LinkConfig
    rng: random.Random = field(default_factory=random.Random)
    free_at: float = 0.0

    def transmitted(self, now: float, nbytes: int) -> float:
        """When a chunk arriving at `now` has been serialized onto the link (seconds)."""
        start = max(now, self.free_at)
        if self.config.bandwidth_mbps > 0:
            start += nbytes * 8 / (self.config.bandwidth_mbps * 1e6)
        self.free_at = start
        return start

    def propagation_s(self) -> float:
        jitter = self.rng.uniform(-self.config.jitter_ms, self.config.jitter_ms) if self.config.jitter_ms else 0.0
        return max(0.0, self.config.delay_ms + jitter) / 1e3


def release_time(tx_end: float, propagation_s: float, last_release: float) -> float:
    """A chunk leaves after its serialization and propagation, and never before the chunk ahead."""
    return max(tx_end + propagation_s, last_release)


@dataclass
class ProxyStats:
    connections: int = 0
    bytes_upstream: int = 0  # client → upstream
    bytes_downstream: int = 0  # upstream → client


class DelayProxy:
    """Listen on `listen_host:listen_port`, forward each connection to `upstream`, delayed."""

    def __init__(
        self,
        upstream: str,
        config: LinkConfig,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        seed: int | None = None,
    ) -> None:
        self.upstream_host, self.upstream_port = split_address(upstream)
        self.config = config
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.stats = ProxyStats()
        rng = random.Random(seed)
        # One clock per direction, shared by all connections: they share the link's bandwidth.
        self._up = LinkClock(config, rng)
        self._down = LinkClock(config, rng)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.listen_port}"

    async def start(self) -> str:
        """Start listening; returns the bound address."""
        self._server = await asyncio.start_server(self._accept, self.listen_host, self.listen_port)
        self.listen_port = int(self._server.sockets[0].getsockname()[1])
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.stats.connections += 1
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
            except OSError:
                client_writer.close()
                return
            pumps = [
                asyncio.create_task(self._pump(client_reader, up_writer, self._up, "bytes_upstream")),
                asyncio.create_task(self._pump(up_reader, client_writer, self._down, "bytes_downstream")),
            ]
            try:
                # A half-close travels through (write_eof); a reset or error ends both directions.
                for finished in asyncio.as_completed(pumps):
                    if not await finished:
                        break
            except asyncio.CancelledError:
                pass  # the proxy is closing: drop the connection
            finally:
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
                for writer in (up_writer, client_writer):
                    writer.close()
        finally:
            self._tasks.discard(task)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, clock: LinkClock, counter: str
    ) -> bool:
        """Copy one direction with delay. True when it ended with a clean EOF, False on an error."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(MAX_QUEUED_CHUNKS)
        last_release = 0.0

        async def receive() -> None:
            nonlocal last_release
            while True:
                data = await reader.read(CHUNK_BYTES)
                now = loop.time()
                if not data:
                    await queue.put((last_release, b""))  # EOF, after everything ahead of it
                    return
                setattr(self.stats, counter, getattr(self.stats, counter) + len(data))
                last_release = release_time(clock.transmitted(now, len(data)), clock.propagation_s(), last_release)
                await queue.put((last_release, data))

        async def deliver() -> None:
            while True:
                release, data = await queue.get()
                wait = release - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()

        receiving = asyncio.create_task(receive())
        try:
            await deliver()
            await receiving
            return True
        except (ConnectionError, OSError):
            return False
        finally:
            receiving.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError, OSError):
                await receiving


def split_address(address: str) -> tuple[str, int]:
    """`host:port` (the last colon splits, so `[::1]:50051` works) → (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m specwire.delay_proxy", description="TCP proxy adding one-way delay, jitter and a bandwidth cap."
    )
    parser.add_argument("--listen", required=True, help="HOST:PORT to listen on (port 0 = any free port)")
    parser.add_argument("--upstream", required=True, help="HOST:PORT to forward to")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per direction (RTT/2)")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="uniform ± jitter on each chunk's delay")
    parser.add_argument("--bandwidth-mbps", type=float, default=0.0, help="per-direction cap in Mbit/s (0 = none)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the jitter")
    return parser


async def _serve(args: argparse.Namespace) -> None:
    host, port = split_address(args.listen)
    config = LinkConfig(args.delay_ms, args.jitter_ms, args.bandwidth_mbps)
    proxy = DelayProxy(args.upstream, config, host, port, args.seed)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    address = await proxy.start()
    # The same READY line the services print: the launcher waits for it.
    print(f"READY proxy {address}", flush=True)
    await stop.wait()
    await proxy.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    watch_parent()  # started by `specwire up` / `bench`: stop when it dies
    try:
        LinkConfig(args.delay_ms, args.jitter_ms, args.bandwidth_mbps)
        split_address(args.listen)
        split_address(args.upstream)
    except ValueError as error:
        raise SystemExit(f"delay_proxy: {error}") from None
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
