"""Several replicas per model role, and sessions that survive losing one (DESIGN.md, principles 3, 9).

`ReplicaSet` is a `ModelHandle` over every replica of one role: the addresses of a comma list,
each `host:port` resolved to all its addresses (a Kubernetes headless Service gives one per pod,
re-resolved as pods come and go). It watches each replica's standard health stream — the
orchestrator's only health watching: whether any replica of the role is healthy goes on to
`orchestrator.health.ServiceStates`, which drives the orchestrator's own health and the
strategies it offers — and opens a new session on the healthy replica with the fewest active
sessions.

`FailoverSession` is a `ModelSession` that keeps the orchestrator's own record of what its
service session holds — per branch, every token it was sent or proposed — by applying each
request and reply as the service does (keep_tokens, branch_order, append_ids, proposals). When
the replica fails (the stream breaks, UNAVAILABLE), it reopens the session on another healthy
replica, re-prefills that record there (one open with the common prefix, one append of what the
branches add to it) and sends the failed request again. The reply is the one the lost replica
would have given: the history is the same, and any seed travels in the request, so the
orchestrator's random state never depends on which replica served. A rebuild is counted
(`CallStats.rebuilds`), traced (`session.rebuild` span) and logged; it is retried with back-off
until `failover_timeout_s`, then the call ends UNAVAILABLE.

A replica that answers RESOURCE_EXHAUSTED (its sessions or KV cache are full) keeps its health:
the session moves to another replica with room, rebuilt the same way, and the caller sees
RESOURCE_EXHAUSTED only when none has room.

A draft role is optional for speculative decoding: when the last draft replica dies mid-generation,
its session proposes nothing, so every further round is a target-only round (lossless, slower),
and it moves back onto a draft replica as soon as one is healthy again. Requests that need draft
scores (contrastive decoding) end UNAVAILABLE instead; so does a new speculative or contrastive
request while no draft replica is healthy (`Decoder` refuses it before it starts).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from specwire.orchestrator.health import ServiceStates
from specwire.orchestrator.models import CallStats, RemoteSession
from specwire.v1 import model_pb2, model_pb2_grpc

from specwire import telemetry, wire
from specwire.errors import StatusError, Unavailable
from specwire.security import ClientTLS, aio_channel
from specwire.serving import CHANNEL_OPTIONS
from specwire.session import ModelInfo, OpenRequest, ScoreKind, Scoring, StepRequest, StepResult

log = logging.getLogger("specwire")

BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 1.0
# A NOT_SERVING replica (loading, draining) is asked again this often at most.
POLL_MAX_S = 0.5
# A replica compiling in the background is asked for `Info` this often until it is done.
INFO_REFRESH_S = 1.0


def split_addresses(spec: str) -> list[tuple[str, int]]:
    """`host:port[,host:port…]` as (host, port) pairs; `[v6]:port` for IPv6 literals."""
    pairs = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"replica address {item!r}: expected host:port")
        pairs.append((host.strip("[]"), int(port)))
    if not pairs:
        raise ValueError(f"no replica address in {spec!r}")
    return pairs


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def dial_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def resolve(spec: str, unresolved: set[str] | None = None) -> list[tuple[str, str | None]]:
    """Every address `spec` names, as (dialed address, certificate name or None). A DNS name
    stands for all its addresses — IPv4 when it has any (one pod, one address), else IPv6.
    Names that do not resolve now are added to `unresolved`."""
    loop = asyncio.get_running_loop()
    unresolved = set() if unresolved is None else unresolved
    found: list[tuple[str, str | None]] = []
    for host, port in split_addresses(spec):
        if is_ip(host):
            found.append((dial_address(host, port), None))
            continue
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as error:
            log.warning("replica name %s does not resolve: %s", host, error)
            unresolved.add(host)
            continue
        v4 = sorted({str(info[4][0]) for info in infos if info[0] == socket.AF_INET})
        v6 = sorted({str(info[4][0]) for info in infos if info[0] == socket.AF_INET6})
        found += [(dial_address(ip, port), host) for ip in (v4 or v6)]
    return list(dict.fromkeys(found))


@dataclass
class Replica:
    """One service process: its channel, health as last reported, sessions it holds now."""

    address: str
    channel: grpc.aio.Channel
    server_name: str | None = None
    state: str = "unknown"  # "serving", "not_serving", "unreachable", "unknown", "mismatched"
    info: ModelInfo | None = None  # checked each time it (re)turns SERVING
    active_sessions: int = 0
    sessions_opened: int = 0
    failures: int = 0
    gone: bool = False  # no longer in DNS: closed once idle
    watcher: asyncio.Task[None] | None = None
    stub: model_pb2_grpc.ModelServiceStub = field(init=False)

    def __post_init__(self) -> None:
        self.stub = model_pb2_grpc.ModelServiceStub(self.channel)

    @property
    def healthy(self) -> bool:
        return self.state == "serving" and not self.gone


@dataclass(frozen=True)
class ReplicaState:
    """A replica as `Info` and the metrics report it."""

    role: str
    address: str
    state: str
    active_sessions: int
    sessions_opened: int
    failures: int


class ReplicaSet:
    """Every replica of one role behind one `ModelHandle`."""

    info: ModelInfo  # the first replica's; every other must serve the same model

    def __init__(
        self,
        spec: str,
        label: str,
        tls: ClientTLS | None = None,
        failover_timeout_s: float = 10.0,
        optional: bool = False,
        resolve_interval_s: float = 10.0,
    ) -> None:
        self.spec = spec
        self.label = label
        self.tls = tls
        self.failover_timeout_s = failover_timeout_s
        self.optional = optional
        self.resolve_interval_s = resolve_interval_s
        self.replicas: dict[str, Replica] = {}
        self.tracing: telemetry.Tracing | None = None
        self.rebuilt = 0  # sessions rebuilt on another replica, over the process's life
        # Told whether any replica is healthy, on every change (the orchestrator's health).
        self._service_states: ServiceStates | None = None
        self._info: ModelInfo | None = None  # set by the first replica that answers `Info`
        self._reference = ""  # that replica's address
        self._changed = asyncio.Event()
        self._resolver: asyncio.Task[None] | None = None

    @classmethod
    async def connect(
        cls,
        spec: str,
        label: str,
        timeout: float,
        tls: ClientTLS | None = None,
        failover_timeout_s: float = 10.0,
        optional: bool = False,
    ) -> ReplicaSet:
        """Resolve `spec`, watch every replica, and wait up to `timeout` for one to give `Info`."""
        replicas = cls(spec, label, tls, failover_timeout_s, optional)
        await replicas._refresh()
        replicas._resolver = asyncio.create_task(replicas._keep_resolving())
        deadline = time.monotonic() + timeout
        while replicas._info is None:
            if time.monotonic() > deadline:
                states = ", ".join(f"{r.address} {r.state}" for r in replicas.replicas.values()) or "none resolved"
                await replicas.close()
                raise Unavailable(f"{label} service unavailable: no replica of {spec} answered within {timeout:.0f}s ({states})")
            await replicas._wait_changed(0.5)
        replicas.info = replicas._info
        return replicas

    @property
    def address(self) -> str:
        """The replicas' addresses as configured (for messages)."""
        return self.spec

    @property
    def any_healthy(self) -> bool:
        return any(replica.healthy for replica in self.replicas.values())

    def follow(self, states: ServiceStates) -> None:
        """Keep `states` told whether a replica of this role is healthy, from now on."""
        self._service_states = states
        self._report()

    def _report(self) -> None:
        if self._service_states is not None:
            self._service_states.set(self.label, self.any_healthy)

    # -- membership and health --------------------------------------------------------------

    async def _refresh(self) -> None:
        """Add the replicas DNS names now; retire those it no longer names (closed once idle)."""
        unresolved: set[str] = set()
        current = dict(await resolve(self.spec, unresolved))
        for address, server_name in current.items():
            if address not in self.replicas:
                channel = aio_channel(address, self.tls, CHANNEL_OPTIONS, server_name)
                replica = self.replicas[address] = Replica(address, channel, server_name)
                replica.watcher = asyncio.create_task(self._watch(replica))
                log.info("%s replica %s added", self.label, address)
        for address, replica in list(self.replicas.items()):
            if replica.server_name in unresolved:
                continue  # a resolver failure is no news about the pods: keep what we have
            replica.gone = address not in current
            if replica.gone and replica.active_sessions == 0:
                await self._drop(replica)
        self._report()

    async def _drop(self, replica: Replica) -> None:
        log.info("%s replica %s removed", self.label, replica.address)
        self.replicas.pop(replica.address, None)
        if replica.watcher is not None:
            replica.watcher.cancel()
        self._report()
        await replica.channel.close()

    async def _keep_resolving(self) -> None:
        if all(is_ip(host) for host, _ in split_addresses(self.spec)):
            return  # literal addresses never change
        while True:
            await asyncio.sleep(self.resolve_interval_s)
            try:
                await self._refresh()
            except Exception:  # a resolver hiccup must not stop the watching
                log.exception("%s: re-resolving %s failed", self.label, self.spec)

    async def _watch(self, replica: Replica) -> None:
        """Follow the replica's health stream; reconnect with back-off while it is unreachable.

        A broken stream marks the replica unreachable at once; the next `Watch` waits for the
        channel to reconnect (its back-off is capped at a second, `serving.CHANNEL_OPTIONS`), so a
        replica that comes back is seen as soon as it reports SERVING.

        A replica that reports NOT_SERVING (loading, or draining for shutdown) is asked again
        after a short back-off instead of held on an open stream: a draining server then exits as
        soon as its sessions end, not when its drain window does. Each time it comes (back) to
        SERVING its `Info` is checked: what restarts at an address may serve another model."""
        health = health_pb2_grpc.HealthStub(replica.channel)
        delay = BACKOFF_FIRST_S
        while True:
            state = "unreachable"
            call = health.Watch(health_pb2.HealthCheckRequest(service=""), wait_for_ready=True)
            compiling: asyncio.Task[None] | None = None
            try:
                async for reply in call:
                    if reply.status != health_pb2.HealthCheckResponse.SERVING:
                        state = "not_serving"
                        break
                    if replica.info is None:
                        self._set_state(replica, await self._check_info(replica))
                        if replica.info is not None and replica.info.compiling and compiling is None:
                            compiling = asyncio.create_task(self._info_once_compiled(replica))
                    else:
                        self._set_state(replica, "serving")
                    delay = BACKOFF_FIRST_S
            except grpc.aio.AioRpcError:
                pass
            finally:
                call.cancel()
                if compiling is not None:
                    compiling.cancel()
            replica.info = None
            self._set_state(replica, state)
            await asyncio.sleep(delay)
            delay = min(2 * delay, POLL_MAX_S)

    async def _check_info(self, replica: Replica) -> str:
        """The replica's `Info`: "serving", or "mismatched" (kept out) when it serves another
        model or vocabulary than the first replica did."""
        reply = await replica.stub.Info(model_pb2.InfoRequest(), timeout=5.0)
        info = wire.info_from_pb(reply)
        replica.info = info
        reference = self._info
        if reference is None:
            self._info, self._reference = info, replica.address
        elif (info.vocab_size, info.tokenizer_fingerprint, info.model_name) != (
            reference.vocab_size, reference.tokenizer_fingerprint, reference.model_name
        ):
            log.error(
                "%s replica %s serves %s (vocab %d), not %s (vocab %d): kept out",
                self.label, replica.address, info.model_name, info.vocab_size, reference.model_name, reference.vocab_size,
            )
            return "mismatched"
        return "serving"

    async def _info_once_compiled(self, replica: Replica) -> None:
        """`Info` again once the replica's background compiler has ended. Until then it gives
        the forward costs and decode step its warm-up timed eagerly, from which speculation plans
        its first rounds (`RunningEstimates.seeded`): Gemma-3-270M's target, 55 ms a token
        against 8 compiled, made target-only rounds look seven times dearer than they are."""
        while True:
            await asyncio.sleep(INFO_REFRESH_S)
            try:
                info = wire.info_from_pb(await replica.stub.Info(model_pb2.InfoRequest(), timeout=5.0))
            except grpc.aio.AioRpcError:
                return  # the health stream sees it too; `_check_info` runs again at SERVING
            replica.info = info
            if replica.address == self._reference:
                self._info = self.info = info
            if not info.compiling:
                return

    def _set_state(self, replica: Replica, state: str) -> None:
        if replica.state != state:
            log.info("%s replica %s: %s -> %s", self.label, replica.address, replica.state, state)
            replica.state = state
            self._report()
        self._changed.set()

    async def _wait_changed(self, timeout: float) -> None:
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    def suspect(self, replica: Replica) -> None:
        """A session on `replica` failed: keep new sessions off it until its health stream
        reports SERVING again (a fresh `Watch` answers at once if it is alive)."""
        replica.failures += 1
        self._set_state(replica, "unreachable")
        if replica.watcher is not None:
            replica.watcher.cancel()
        replica.watcher = asyncio.create_task(self._watch(replica))

    # -- sessions -----------------------------------------------------------------------------

    def pick(self, exclude: frozenset[str] = frozenset()) -> Replica | None:
        """The healthy replica with the fewest active sessions (ties: fewest opened, for spread),
        leaving out the addresses in `exclude`."""
        healthy = [r for r in self.replicas.values() if r.healthy and r.address not in exclude]
        if not healthy:
            return None
        return min(healthy, key=lambda r: (r.active_sessions, r.sessions_opened))

    async def acquire(self, deadline: float | None, exclude: frozenset[str] = frozenset()) -> Replica:
        """A healthy replica, waiting with back-off until `deadline` (monotonic; None: no wait)."""
        delay = BACKOFF_FIRST_S
        while True:
            replica = self.pick(exclude)
            if replica is not None:
                replica.active_sessions += 1
                replica.sessions_opened += 1
                return replica
            if deadline is None or time.monotonic() >= deadline:
                states = ", ".join(f"{r.address} {r.state}" for r in self.replicas.values()) or "none resolved"
                raise Unavailable(f"{self.label} service unavailable: no healthy replica ({states})")
            await self._wait_changed(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(2 * delay, BACKOFF_MAX_S)

    async def release(self, replica: Replica) -> None:
        replica.active_sessions -= 1
        if replica.gone and replica.active_sessions == 0:
            await self._drop(replica)

    def session(self, stats: CallStats) -> FailoverSession:
        return FailoverSession(self, stats)

    def states(self) -> list[ReplicaState]:
        return [
            ReplicaState(self.label, r.address, r.state, r.active_sessions, r.sessions_opened, r.failures)
            for r in sorted(self.replicas.values(), key=lambda r: r.address)
        ]

    async def close(self) -> None:
        if self._resolver is not None:
            self._resolver.cancel()
        for replica in list(self.replicas.values()):
            await self._drop(replica)


def _common_prefix(rows: list[list[int]]) -> int:
    length = min(len(row) for row in rows)
    for index in range(length):
        token = rows[0][index]
        if any(row[index] != token for row in rows):
            return index
    return length


class FailoverSession:
    """A `ModelSession` on one replica at a time, rebuilt on another when its replica fails."""

    def __init__(self, replicas: ReplicaSet, stats: CallStats) -> None:
        self._replicas = replicas
        self._stats = stats
        self._replica: Replica | None = None
        self._session: RemoteSession | None = None
        self._opening: OpenRequest | None = None  # None until opened, or once not rebuildable
        # What the service session holds, branch by branch: the orchestrator's own record.
        self._tokens: list[list[int]] = []
        self._degraded = False  # an optional role with no replica: proposes nothing

    # -- the ModelSession interface ---------------------------------------------------------------

    async def open(self, request: OpenRequest) -> StepResult:
        self._opening = request
        self._tokens = [list(request.prompt_ids) for _ in range(request.num_branches)]
        return await self._send(
            lambda session: session.open(request), lambda: self._degraded_reply(request.scoring), request.trace, False
        )

    async def step(self, request: StepRequest) -> StepResult:
        if self._degraded and not await self._recover(request.trace):
            result = self._degraded_reply(request.scoring, request.propose)
        else:
            result = await self._send(
                lambda session: session.step(request),
                lambda: self._degraded_reply(request.scoring, request.propose),
                request.trace,
                True,
            )
        self._follow(request, result)
        return result

    async def close(self) -> None:
        await self._leave()

    # -- the record ---------------------------------------------------------------------------

    def _follow(self, request: StepRequest, result: StepResult) -> None:
        """Apply `request` and its reply to the record, as the service applied them."""
        if request.tree_parents or self._opening is None:
            self._opening = None  # tree tokens are not a history: such a session is not rebuilt
            return
        rows = self._tokens
        if request.keep_tokens is not None:
            rows = [row[: request.keep_tokens] for row in rows]
        if request.branch_order:
            rows = [list(rows[index]) for index in request.branch_order]
        if request.append_ids:
            per_branch = len(request.append_ids) // len(rows)
            rows = [row + request.append_ids[i * per_branch : (i + 1) * per_branch] for i, row in enumerate(rows)]
        if result.proposed_ids is not None:
            proposed = result.proposed_ids.reshape(len(rows), -1).tolist()
            rows = [row + extra for row, extra in zip(rows, proposed, strict=True)]
        self._tokens = rows
        if result.num_tokens and result.num_tokens != len(rows[0]):
            log.warning("%s session holds %d tokens, record says %d: not rebuildable", self._label, result.num_tokens, len(rows[0]))
            self._opening = None

    @property
    def _label(self) -> str:
        return self._replicas.label

    async def _attach(self, deadline: float | None, exclude: frozenset[str] = frozenset()) -> None:
        replica = await self._replicas.acquire(deadline, exclude)
        self._replica = replica
        self._session = RemoteSession(replica.stub, self._label, self._stats, self._replicas.tracing)

    async def _leave(self) -> None:
        session, replica = self._session, self._replica
        self._session, self._replica = None, None
        if session is not None:
            await session.close()
        if replica is not None:
            await self._replicas.release(replica)

    async def _fail(self) -> str:
        """The current replica failed: suspect it and drop the session (its KV cache is lost there)."""
        replica = self._replica
        assert replica is not None
        self._replicas.suspect(replica)
        await self._leave()
        return replica.address

    # -- failover -----------------------------------------------------------------------------

    async def _send(
        self,
        send: Callable[[RemoteSession], Awaitable[StepResult]],
        degraded: Callable[[], StepResult],
        trace: dict[str, str] | None,
        rebuild: bool,
    ) -> StepResult:
        """`send` on the current replica; on failure, rebuild on another and send again, with
        back-off, until `failover_timeout_s`. An optional role with no replica answers `degraded`."""
        deadline = time.monotonic() + self._replicas.failover_timeout_s
        lost: str | None = None
        reason = ""
        full: frozenset[str] = frozenset()  # replicas that answered RESOURCE_EXHAUSTED to this call
        while True:
            if self._session is None:
                try:
                    # An optional role does not wait for a replica: target-only rounds go on now.
                    await self._attach(None if self._replicas.optional or full else deadline, full)
                except Unavailable as failure:
                    if self._replicas.optional and self._opening is not None:
                        self._degrade(failure)
                        return degraded()
                    raise
                if lost is not None and rebuild:
                    try:
                        await self._rebuild(lost, reason, trace)
                    except _RebuildImpossible:
                        await self._leave()
                        raise
                    except Unavailable as failure:
                        lost, reason = await self._fail(), failure.message
                        if time.monotonic() >= deadline:
                            raise
                        continue
            assert self._session is not None and self._replica is not None
            try:
                return await send(self._session)
            except StatusError as failure:
                if failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED and self._replicas.pick(full | {self._replica.address}):
                    # Full here, room elsewhere: move the session there, rebuilt from the record.
                    full |= {self._replica.address}
                    lost, reason = self._replica.address, failure.message
                    await self._leave()
                    if rebuild and self._opening is None:
                        raise
                    continue
                if not _replica_lost(failure):
                    raise
                lost, reason = await self._fail(), failure.message
                if (rebuild and self._opening is None) or time.monotonic() >= deadline:
                    raise

    async def _rebuild(self, lost: str, reason: str, trace: dict[str, str] | None) -> None:
        """Re-prefill the record on the newly attached replica: open with the branches' common
        prefix, then one append of what each branch adds. No scoring: the forward pass runs with
        the request that failed, sent again next."""
        if self._opening is None:
            raise _RebuildImpossible(f"{self._label} service unavailable: the session on {lost} was lost and cannot be rebuilt")
        assert self._session is not None and self._replica is not None
        rows = self._tokens
        prefix = _common_prefix(rows)
        held = sum(len(row) for row in rows)
        span = None
        tracing = self._replicas.tracing
        if tracing is not None:
            span = tracing.start_span(
                "session.rebuild",
                telemetry.extract(trace),
                attributes={
                    "specwire.peer": self._label,
                    "specwire.rebuild.from": lost,
                    "specwire.rebuild.to": self._replica.address,
                    "specwire.rebuild.tokens": held,
                    "specwire.rebuild.branches": len(rows),
                },
            )
        carrier = telemetry.carrier(span) if span is not None else None
        try:
            opening = OpenRequest(rows[0][:prefix], self._opening.processing, len(rows), Scoring(ScoreKind.NONE), carrier)
            await self._session.open(opening)
            rest = [token for row in rows for token in row[prefix:]]
            if rest:
                await self._session.step(StepRequest(append_ids=rest, trace=carrier))
        except BaseException as failure:
            if span is not None:
                telemetry.record_error(span, failure)
                span.end()
            raise
        if span is not None:
            span.end()
        self._stats.rebuilds += 1
        self._replicas.rebuilt += 1
        log.warning(
            "%s session rebuilt on %s after %s failed (%s): %d branch(es), %d tokens re-prefilled",
            self._label, self._replica.address, lost, reason, len(rows), held,
        )

    # -- an optional role with no replica left ----------------------------------------------------

    def _degrade(self, failure: Unavailable) -> None:
        if not self._degraded:
            log.warning("%s: %s; proposing nothing (target-only rounds) until a replica is back", self._label, failure.message)
        self._degraded = True

    def _degraded_reply(self, scoring: Scoring, propose: int = 0) -> StepResult:
        if scoring.kind != ScoreKind.NONE:
            raise Unavailable(f"{self._label} service unavailable: no replica left, and this strategy needs its scores")
        return StepResult(proposed_ids=torch.empty((len(self._tokens), 0), dtype=torch.int32) if propose else None)

    async def _recover(self, trace: dict[str, str] | None) -> bool:
        """Back onto a replica if one is healthy now, rebuilt from the record."""
        if self._replicas.pick() is None or self._opening is None:
            return False
        try:
            await self._attach(None)
            await self._rebuild("no replica", "recovering", trace)
        except Unavailable:
            await self._leave()
            return False
        self._degraded = False
        return True


class ReplicaCollector:
    """Prometheus view of the replicas: health, active sessions, sessions rebuilt per role."""

    def __init__(self, sets: list[ReplicaSet]) -> None:
        self.sets = sets

    def collect(self) -> Iterator[Metric]:
        serving = GaugeMetricFamily(
            "specwire_replica_serving", "1 when the replica reports SERVING on its health stream", labels=["role", "address"]
        )
        active = GaugeMetricFamily("specwire_replica_active_sessions", "Sessions open on the replica", labels=["role", "address"])
        failures = CounterMetricFamily("specwire_replica_failures", "Sessions lost with the replica", labels=["role", "address"])
        rebuilt = CounterMetricFamily(
            "specwire_sessions_rebuilt", "Sessions rebuilt on another replica from the orchestrator's history", labels=["role"]
        )
        for replicas in self.sets:
            for state in replicas.states():
                labels = [state.role, state.address]
                serving.add_metric(labels, 1.0 if state.state == "serving" else 0.0)
                active.add_metric(labels, state.active_sessions)
                failures.add_metric(labels, state.failures)
            rebuilt.add_metric([replicas.label], replicas.rebuilt)
        yield from (serving, active, failures, rebuilt)


def _replica_lost(error: StatusError) -> bool:
    """Whether `error` means the replica (or the way to it) failed, not the request: UNAVAILABLE,
    or the INTERNAL status gRPC's own transport reports when a connection dies mid-message."""
    if isinstance(error, Unavailable):
        return True
    return error.code == grpc.StatusCode.INTERNAL and "Internal error from Core" in error.message


class _RebuildImpossible(Unavailable):
    """The session cannot be rebuilt (its record is incomplete): no retry helps."""
