"""Transport security and caller authentication: TLS/mTLS credentials, bearer tokens, a private CA.

- Servers take a certificate and key, and with a client CA require client certificates signed by
  it (mutual TLS); clients take the CA that signed the server's certificate, and their own
  certificate and key where the server requires one.
- The orchestrator's public API takes `authorization: Bearer <token>` metadata checked against
  a token file (one token per line, re-read when it changes). Health and reflection stay open,
  so probes and grpcurl work without a secret.
- `make_certificates` writes a private CA and a certificate per service (for `specwire up --tls`).

No token or key is ever logged or put on a span; refusals name the field, never the value.
"""

from __future__ import annotations

import datetime
import hmac
import ipaddress
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger("specwire")

# Methods any caller may use: the standard health protocol and server reflection.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise SystemExit(f"{flag}: cannot read {path}: {error.strerror}") from None


@dataclass(frozen=True)
class ServerTLS:
    """`--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]`: the last requires client certificates."""

    cert: str
    key: str
    client_ca: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        client_ca = _read(self.client_ca, "--tls-client-ca") if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(_read(self.key, "--tls-key"), _read(self.cert, "--tls-cert"))],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )


@dataclass(frozen=True)
class ClientTLS:
    """`--tls-ca FILE [--tls-cert FILE --tls-key FILE]`: whom to trust, and who we are."""

    ca: str
    cert: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("tls_cert and tls_key: give both or neither")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "--tls-ca"),
            private_key=_read(self.key, "--tls-key") if self.key else None,
            certificate_chain=_read(self.cert, "--tls-cert") if self.cert else None,
        )


def server_tls(cert: str | None, key: str | None, client_ca: str | None) -> ServerTLS | None:
    """Server flags as a `ServerTLS` (None: plaintext), refusing half a configuration."""
    if cert is None and key is None:
        if client_ca:
            raise SystemExit("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if cert is None or key is None:
        raise SystemExit("--tls-cert and --tls-key: give both or neither")
    return ServerTLS(cert, key, client_ca)


def client_tls(ca: str | None, cert: str | None, key: str | None) -> ClientTLS | None:
    """Client flags as a `ClientTLS` (None: plaintext), refusing half a configuration."""
    if ca is None:
        if cert or key:
            raise SystemExit("--tls-cert/--tls-key on a client need --tls-ca")
        return None
    if (cert is None) != (key is None):
        raise SystemExit("--tls-cert and --tls-key: give both or neither")
    return ClientTLS(ca, cert, key)


def aio_channel(
    address: str,
    tls: ClientTLS | None,
    options: Sequence[tuple[str, Any]] = (),
    server_name: str | None = None,
) -> grpc.aio.Channel:
    """An asyncio channel, TLS when `tls` is given. `server_name` is the name the certificate must
    carry when `address` is one of the addresses a DNS name resolved to."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    extra = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.aio.secure_channel(address, tls.credentials(), options=[*options, *extra])


def sync_channel(address: str, tls: ClientTLS | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.credentials(), options=list(options))


# -- bearer tokens -----------------------------------------------------------------------------


class TokenFile:
    """The accepted tokens: one per line of a file, blank lines and `#` comments ignored, re-read
    whenever the file's modification time or size changes (rotate a token by editing the file)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._tokens: list[bytes] = []
        self._load()
        if not self._tokens:
            raise SystemExit(f"--auth-token-file: {path} holds no token")

    def _load(self) -> None:
        try:
            stat = os.stat(self.path)
        except OSError as error:
            if self._stamp is None:
                raise SystemExit(f"--auth-token-file: cannot read {self.path}: {error.strerror}") from None
            log.warning("auth token file unreadable (%s); keeping the tokens read before", error.strerror)
            return
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._stamp:
            return
        lines = Path(self.path).read_text().splitlines()
        tokens = [line.strip().encode() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if self._stamp is not None:
            log.info("auth token file changed: %d tokens accepted", len(tokens))
        self._stamp, self._tokens = stamp, tokens

    def accepts(self, token: str) -> bool:
        self._load()
        offered = token.encode()
        # Compare against every token in constant time per comparison; no early exit on a match.
        matches = [hmac.compare_digest(offered, known) for known in self._tokens]
        return any(matches)


def bearer_token(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):].strip()
    return None


class TokenAuth(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for any call but health and reflection without an accepted bearer token."""

    def __init__(self, tokens: TokenFile) -> None:
        self.tokens = tokens

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method or ""
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        token = bearer_token(details.invocation_metadata)  # type: ignore[arg-type]
        if token is None:
            return _refusal(handler, "authorization: missing `Bearer <token>` metadata")
        if not self.tokens.accepts(token):
            return _refusal(handler, "authorization: token not accepted")
        return handler


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call UNAUTHENTICATED."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises

    codec = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **codec)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **codec)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **codec)
    return grpc.stream_stream_rpc_method_handler(streaming, **codec)


# -- a private CA for `specwire up --tls` -------------------------------------------------------

SERVICE_NAMES = ("orchestrator", "draft", "target")


def make_certificates(directory: Path, hosts: Sequence[str] = ("localhost", "127.0.0.1")) -> dict[str, tuple[Path, Path]]:
    """A private CA (`ca.pem`) and, for each service and for a `client`, a key and a certificate
    signed by it, valid for `hosts` and the service's name, usable as server and as client.
    Returns {name: (cert, key)}; keys are written owner-readable only. The CA's own key is
    discarded, so a leaked directory cannot mint new identities."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=365))

    def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(pem)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "specwire private CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(valid[0]).not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    # The CA's key is not kept: nothing can be signed by this CA after this call.
    (directory / "ca.pem").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))

    def alt_names(extra: str) -> list[x509.GeneralName]:
        names: list[x509.GeneralName] = []
        for host in dict.fromkeys([*hosts, extra]):
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        return names

    issued: dict[str, tuple[Path, Path]] = {}
    for name in (*SERVICE_NAMES, "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"specwire {name}")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(valid[0]).not_valid_after(valid[1])
            .add_extension(x509.SubjectAlternativeName(alt_names(f"specwire-{name}")), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
            )
            .sign(ca_key, hashes.SHA256())
        )
        cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        write_key(key_path, key)
        issued[name] = (cert_path, key_path)
    return issued
