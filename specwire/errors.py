"""Errors that carry a gRPC status: raised anywhere inside, mapped to a status at the edge."""

from __future__ import annotations

import grpc

MAX_MESSAGE_CHARS = 1024  # status details travel as metadata, which has a size limit


def capped(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return message if len(message) <= limit else message[:limit] + "…"


class StatusError(Exception):
    """An error the caller should see with a specific gRPC status code."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        message = capped(message)
        super().__init__(message)
        self.message = message


class InvalidArgument(StatusError):
    """A request field is out of bounds. The message starts with the field's name."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


ECHO_LIMIT = 64


def echo(value: object, limit: int = ECHO_LIMIT) -> str:
    """`repr(value)` for an error message, cut to `limit` characters with "…": a message echoes
    the caller's value, and a long one would not fit the status metadata."""
    shown = repr(value)
    return shown if len(shown) <= limit else shown[:limit] + "…"


def check_token_ids(ids: list[int], vocab_size: int, field: str) -> None:
    """INVALID_ARGUMENT naming `field` unless every id is in [0, vocab_size)."""
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise InvalidArgument(field, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


class ResourceExhausted(StatusError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(StatusError):
    code = grpc.StatusCode.UNAVAILABLE


class FailedPrecondition(StatusError):
    code = grpc.StatusCode.FAILED_PRECONDITION
