"""Mutual TLS on every hop and bearer tokens on the public API, on real loopback sockets.

One private CA signs the services' certificates (as `specwire up --tls` makes them); a second
CA stands for an outsider. Every path without the right certificate or token is refused; health
stays open.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from specwire.client import Client, GenerationError
from specwire.client.launcher import free_base_port
from specwire.orchestrator.replicas import ReplicaSet
from specwire.orchestrator.server import SERVICE_NAME as ORCHESTRATOR_SERVICE
from specwire.orchestrator.server import OrchestratorServicer, build_decoder
from specwire.v1 import model_pb2, model_pb2_grpc, orchestrator_pb2_grpc

from specwire import serving
from specwire.config import OrchestratorConfig
from specwire.errors import Unavailable
from specwire.model_service import SERVICE_NAME as MODEL_SERVICE
from specwire.model_service import ModelServicer
from specwire.security import ClientTLS, ServerTLS, TokenAuth, TokenFile, make_certificates
from tests.conftest import load_engine
from tests.harness import LoopThread

TOKEN = "s3cret-token-for-tests"


@dataclass
class SecureStack:
    ours: dict[str, tuple[Path, Path]]
    theirs: dict[str, tuple[Path, Path]]
    ca: Path
    other_ca: Path
    token_file: Path
    orchestrator: str
    target: str
    draft: str
    servers: list[serving.RunningServer]

    def tls(self, name: str, ca: Path | None = None) -> ClientTLS:
        cert, key = self.ours[name]
        return ClientTLS(str(ca or self.ca), str(cert), str(key))


def _server_tls(issued: dict[str, tuple[Path, Path]], name: str, ca: Path) -> ServerTLS:
    cert, key = issued[name]
    return ServerTLS(str(cert), str(key), str(ca))


@pytest.fixture(scope="module")
def secure(loop: LoopThread, tmp_path_factory: pytest.TempPathFactory, llama_target_dir: Path, llama_draft_dir: Path) -> Iterator[SecureStack]:
    ours_dir, theirs_dir = tmp_path_factory.mktemp("pki"), tmp_path_factory.mktemp("other-pki")
    ours, theirs = make_certificates(ours_dir), make_certificates(theirs_dir)
    ca = ours_dir / "ca.pem"
    token_file = ours_dir / "tokens"
    token_file.write_text(f"# one per line\n{TOKEN}\n")

    async def start() -> tuple[list[serving.RunningServer], dict[str, str]]:
        servers, addresses = [], {}
        for role, model_dir in (("target", llama_target_dir), ("draft", llama_draft_dir)):
            servicer = ModelServicer(load_engine(model_dir, role))

            def register(server: grpc.aio.Server, servicer: ModelServicer = servicer) -> None:
                model_pb2_grpc.add_ModelServiceServicer_to_server(servicer, server)

            running = await serving.start_server(
                register, [MODEL_SERVICE], "127.0.0.1", 0, tls=_server_tls(ours, role, ca), health_port=free_base_port(1)
            )
            await serving.mark_serving(running, [MODEL_SERVICE])
            servers.append(running)
            addresses[role] = f"127.0.0.1:{running.port}"
        cert, key = ours["orchestrator"]
        config = OrchestratorConfig(
            target=addresses["target"], draft=addresses["draft"], tokenizer=str(llama_target_dir), connect_timeout_s=10.0,
            services_tls=ClientTLS(str(ca), str(cert), str(key)),
        )
        servicer = OrchestratorServicer(await build_decoder(config))

        def register_orchestrator(server: grpc.aio.Server) -> None:
            orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server)

        running = await serving.start_server(
            register_orchestrator, [ORCHESTRATOR_SERVICE], "127.0.0.1", 0,
            interceptors=[TokenAuth(TokenFile(str(token_file)))], tls=_server_tls(ours, "orchestrator", ca),
        )
        await serving.mark_serving(running, [ORCHESTRATOR_SERVICE])
        servers.append(running)
        addresses["orchestrator"] = f"127.0.0.1:{running.port}"
        return servers, addresses

    servers, addresses = loop.run(start())
    yield SecureStack(
        ours, theirs, ca, theirs_dir / "ca.pem", token_file,
        addresses["orchestrator"], addresses["target"], addresses["draft"], servers,
    )
    for running in servers:
        loop.run(running.server.stop(0))


def client(stack: SecureStack, token: str | None = TOKEN) -> Client:
    """A client with our CA's client certificate and `token`."""
    cert, key = stack.ours["client"]
    return Client(stack.orchestrator, timeout=30, tls_ca=str(stack.ca), tls_cert=str(cert), tls_key=str(key), token=token)


def test_mutual_tls_on_every_hop_serves_a_speculative_generation(secure: SecureStack) -> None:
    with client(secure) as c:
        result = c.generate(prompt="def", strategy="speculative", num_speculative_tokens=3, max_new_tokens=8,
                            ignore_eos=True)
        assert len(result.token_ids) == 8 and result.stats.drafted_tokens > 0  # orchestrator → draft and → target
        assert {(r.role, r.state) for r in c.info().replicas} == {("target", "serving"), ("draft", "serving")}


def test_a_client_without_a_certificate_is_refused(secure: SecureStack) -> None:
    with Client(secure.orchestrator, timeout=10, tls_ca=str(secure.ca), token=TOKEN) as c, pytest.raises(GenerationError) as refused:
        c.generate(prompt="def", max_new_tokens=2)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_client_with_another_cas_certificate_is_refused(secure: SecureStack) -> None:
    cert, key = secure.theirs["client"]
    c = Client(secure.orchestrator, timeout=10, tls_ca=str(secure.ca), tls_cert=str(cert), tls_key=str(key), token=TOKEN)
    with c, pytest.raises(GenerationError) as refused:
        c.generate(prompt="def", max_new_tokens=2)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_plaintext_client_is_refused(secure: SecureStack) -> None:
    with Client(secure.orchestrator, timeout=10, token=TOKEN) as c, pytest.raises(GenerationError) as refused:
        c.generate(prompt="def", max_new_tokens=2)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("who", ["no certificate", "another CA's certificate", "plaintext"])
def test_the_model_services_refuse_an_orchestrator_without_our_certificate(loop: LoopThread, secure: SecureStack, who: str) -> None:
    cert, key = secure.theirs["orchestrator"]
    tls = {
        "no certificate": ClientTLS(str(secure.ca)),
        "another CA's certificate": ClientTLS(str(secure.ca), str(cert), str(key)),
        "plaintext": None,
    }[who]
    for address in (secure.target, secure.draft):
        with pytest.raises(Unavailable, match="no replica .* answered"):
            loop.run(ReplicaSet.connect(address, "target", 1.0, tls))


def test_replicas_found_through_a_dns_name_are_verified_against_that_name(loop: LoopThread, secure: SecureStack) -> None:
    """`localhost:PORT` is dialed at 127.0.0.1 and the certificate checked for `localhost`."""
    port = secure.target.split(":")[1]

    async def connect() -> list[str]:
        replicas = await ReplicaSet.connect(f"localhost:{port}", "target", 10.0, secure.tls("orchestrator"))
        states = [f"{state.address} {state.state}" for state in replicas.states()]
        await replicas.close()
        return states

    assert loop.run(connect()) == [f"127.0.0.1:{port} serving"]


def test_a_service_certificate_from_another_ca_is_not_trusted(loop: LoopThread, secure: SecureStack) -> None:
    """The orchestrator trusts only its CA: a service it cannot verify is never used."""
    with pytest.raises(Unavailable, match="no replica .* answered"):
        loop.run(ReplicaSet.connect(secure.target, "target", 1.5, secure.tls("orchestrator", secure.other_ca)))


def _reflected_services(c: Client) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(c._channel)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    return {service.name for reply in replies for service in reply.list_services_response.service}


def test_tokens_are_required_and_health_and_reflection_stay_open(secure: SecureStack, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    for token, problem in ((None, "missing"), ("wrong-token", "not accepted")):
        with client(secure, token=token) as c:
            assert c.health() == "SERVING"
            assert ORCHESTRATOR_SERVICE in _reflected_services(c)
            with pytest.raises(GenerationError) as refused:
                c.generate(prompt="def", max_new_tokens=2)
            assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert refused.value.message.startswith("authorization:") and problem in refused.value.message
            with pytest.raises(GenerationError) as streamed:
                list(c.stream(prompt="def", max_new_tokens=2))
            assert streamed.value.code == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as info:
                c.info()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    with client(secure) as c:
        assert c.health() == "SERVING"
        assert len(c.generate(prompt="def", max_new_tokens=2, ignore_eos=True).token_ids) == 2
    assert all(TOKEN not in record.getMessage() and "wrong-token" not in record.getMessage() for record in caplog.records)


def test_probes_reach_health_on_the_plaintext_health_port_only(secure: SecureStack) -> None:
    """kubelet's gRPC probe cannot speak TLS: `--health-port` serves health alone, in plaintext."""
    target = secure.servers[0]
    assert target.health_port
    with grpc.insecure_channel(f"127.0.0.1:{target.health_port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as other:  # nothing but health on it
            model_pb2_grpc.ModelServiceStub(channel).Info(model_pb2.InfoRequest(), timeout=5)
        assert other.value.code() == grpc.StatusCode.UNIMPLEMENTED  # type: ignore[attr-defined]


def test_the_token_file_is_reread_when_it_changes(secure: SecureStack) -> None:
    original = secure.token_file.read_text()
    try:
        secure.token_file.write_text("rotated-token\n")
        with client(secure) as c, pytest.raises(GenerationError) as refused:
            c.generate(prompt="def", max_new_tokens=2)
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
        with client(secure, token="rotated-token") as c:
            assert len(c.generate(prompt="def", max_new_tokens=2, ignore_eos=True).token_ids) == 2
    finally:
        secure.token_file.write_text(original)


MALFORMED = b"\x0a\xff\xff\xff\xff"  # field 1, length-delimited, with a length past the end


def test_malformed_bytes_are_unauthenticated_without_a_token_and_invalid_argument_with_one(secure: SecureStack) -> None:
    """The token is checked on the metadata before the request is parsed; an authenticated
    caller's unparseable bytes still get INVALID_ARGUMENT, not grpcio's UNKNOWN."""
    cert, key = secure.ours["client"]
    credentials = grpc.ssl_channel_credentials(secure.ca.read_bytes(), key.read_bytes(), cert.read_bytes())
    with grpc.secure_channel(secure.orchestrator, credentials) as channel:
        generate = channel.unary_unary("/specwire.v1.Orchestrator/Generate")
        for metadata, code in (
            ((), grpc.StatusCode.UNAUTHENTICATED),
            ((("authorization", "Bearer wrong-token"),), grpc.StatusCode.UNAUTHENTICATED),
            ((("authorization", f"Bearer {TOKEN}"),), grpc.StatusCode.INVALID_ARGUMENT),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                generate(MALFORMED, timeout=10, metadata=metadata)
            assert caught.value.code() == code, caught.value  # type: ignore[attr-defined]
            prefix = "request: malformed" if code == grpc.StatusCode.INVALID_ARGUMENT else "authorization:"
            assert caught.value.details().startswith(prefix)  # type: ignore[attr-defined]
