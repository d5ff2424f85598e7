"""The delay proxy: delays round trips by the configured RTT, keeps bytes exact and in order, caps
bandwidth, runs standalone, and leaves generations through it unchanged."""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from specwire.client.sdk import Client

from specwire.delay_proxy import DelayProxy, LinkClock, LinkConfig, release_time, split_address
from tests.harness import LoopThread, Stack, start_orchestrator


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _echo_server() -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


@asynccontextmanager
async def _proxied_echo(config: LinkConfig, seed: int | None = None) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    server, address = await _echo_server()
    proxy = DelayProxy(address, config, seed=seed)
    await proxy.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.listen_port)
    try:
        yield reader, writer
    finally:
        writer.close()
        await proxy.close()
        server.close()


def test_release_never_reorders_chunks_under_jitter() -> None:
    clock = LinkClock(LinkConfig(delay_ms=5, jitter_ms=5), random.Random(1))
    last = 0.0
    for arrival in [i * 1e-4 for i in range(200)]:
        released = release_time(clock.transmitted(arrival, 100), clock.propagation_s(), last)
        assert released >= last and released >= arrival
        last = released


def test_serialization_delay_is_bytes_over_bandwidth_and_queues() -> None:
    clock = LinkClock(LinkConfig(bandwidth_mbps=8.0))  # 1 byte per µs
    assert clock.transmitted(0.0, 1000) == pytest.approx(1e-3)
    assert clock.transmitted(0.0, 1000) == pytest.approx(2e-3)  # waits for the link to be free
    assert clock.transmitted(1.0, 1000) == pytest.approx(1.001)


def test_jitter_stays_within_bounds_and_never_negative() -> None:
    clock = LinkClock(LinkConfig(delay_ms=1, jitter_ms=3), random.Random(0))
    delays = [clock.propagation_s() for _ in range(500)]
    assert min(delays) == 0.0 and max(delays) <= 4e-3


def test_bad_link_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        LinkConfig(delay_ms=-1)
    with pytest.raises(ValueError):
        split_address("localhost")
    assert split_address("[::1]:50051") == ("::1", 50051)


def test_round_trip_takes_at_least_the_configured_rtt(loop: LoopThread) -> None:
    async def measure() -> tuple[float, float]:
        direct_server, direct_address = await _echo_server()
        host, port = split_address(direct_address)
        times = {}
        for label, config in (("proxied", LinkConfig(delay_ms=20)), ("direct", None)):
            proxy = None
            if config is not None:
                proxy = DelayProxy(direct_address, config)
                await proxy.start()
            reader, writer = await asyncio.open_connection(host, proxy.listen_port if proxy else port)
            samples = []
            for _ in range(5):
                started = time.perf_counter()
                writer.write(b"ping")
                await reader.readexactly(4)
                samples.append((time.perf_counter() - started) * 1e3)
            times[label] = statistics.median(samples)
            writer.close()
            if proxy is not None:
                await proxy.close()
        direct_server.close()
        return times["proxied"], times["direct"]

    proxied_ms, direct_ms = loop.run(measure())
    assert proxied_ms >= 0.8 * 40.0, f"RTT through a 20 ms one-way proxy was {proxied_ms:.1f} ms"
    assert direct_ms < proxied_ms


def test_bytes_arrive_exact_and_in_order_with_jitter(loop: LoopThread) -> None:
    payload = os.urandom(3 * 1024 * 1024 + 17)

    async def roundtrip() -> bytes:
        async with _proxied_echo(LinkConfig(delay_ms=2, jitter_ms=2), seed=3) as (reader, writer):

            async def send() -> None:
                for start in range(0, len(payload), 50_000):  # many chunks, each with its own jitter
                    writer.write(payload[start : start + 50_000])
                    await writer.drain()

            sending = asyncio.create_task(send())
            received = await reader.readexactly(len(payload))
            await sending
            return received

    assert loop.run(roundtrip()) == payload


def test_bandwidth_cap_bounds_transfer_time(loop: LoopThread) -> None:
    payload = os.urandom(250_000)  # 2 Mbit: ≥ 0.25 s at 8 Mbit/s, in each direction (pipelined)

    async def transfer() -> float:
        async with _proxied_echo(LinkConfig(bandwidth_mbps=8.0)) as (reader, writer):
            started = time.perf_counter()
            writer.write(payload)
            await writer.drain()
            assert await reader.readexactly(len(payload)) == payload
            return time.perf_counter() - started

    assert loop.run(transfer()) >= 0.8 * 0.25


def test_standalone_proxy_prints_ready_and_forwards(loop: LoopThread) -> None:
    server, address = loop.run(_echo_server())
    process = subprocess.Popen(
        [sys.executable, "-m", "specwire.delay_proxy", "--listen", "127.0.0.1:0", "--upstream", address, "--delay-ms", "5"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline().split()
        assert line[:2] == ["READY", "proxy"], line
        host, port = split_address(line[2])

        async def ping() -> float:
            reader, writer = await asyncio.open_connection(host, port)
            started = time.perf_counter()
            writer.write(b"hello")
            assert await reader.readexactly(5) == b"hello"
            writer.close()
            return time.perf_counter() - started

        assert loop.run(ping()) >= 0.8 * 0.010
    finally:
        process.terminate()
        process.wait(10)
        server.close()
    assert process.returncode == 0


def test_generation_through_proxies_equals_direct(loop: LoopThread, llama_stack: Stack, llama_target_dir: object) -> None:
    rtt_ms = 10.0
    proxies = [DelayProxy(server.address, LinkConfig(delay_ms=rtt_ms / 2)) for server in (llama_stack.target, llama_stack.draft)]
    target_address, draft_address = (loop.run(proxy.start()) for proxy in proxies)
    orchestrator = loop.run(start_orchestrator(target_address, draft_address, str(llama_target_dir)))
    try:
        request: dict[str, Any] = {"max_new_tokens": 8, "ignore_eos": True}
        with Client(llama_stack.address, timeout=60) as direct, Client(orchestrator.address, timeout=60) as proxied:
            for strategy in ("greedy", "speculative"):
                expected = direct.generate("def add(a, b):", strategy=strategy, **request)
                got = proxied.generate("def add(a, b):", strategy=strategy, **request)
                assert got.token_ids == expected.token_ids, strategy
                # Every round waits on the delayed link: network time carries the RTT.
                s = got.stats
                assert s.target_network_ms + s.draft_network_ms >= 0.8 * rtt_ms * s.rounds
    finally:
        loop.run(orchestrator.running.server.stop(0))
        for proxy in proxies:
            loop.run(proxy.close())
