"""Persimmon's one error hierarchy, mapped once to gRPC and HTTP status.

    PersimmonError
    ├── InvalidArgument          INVALID_ARGUMENT     400
    │   ├── MalformedMessage     INVALID_ARGUMENT     400
    │   ├── WrongShard           INVALID_ARGUMENT     400
    │   └── ConfigError          INVALID_ARGUMENT     400
    ├── NotFound                 NOT_FOUND            404
    ├── AlreadyExists            ALREADY_EXISTS       409
    ├── FailedPrecondition       FAILED_PRECONDITION  412
    │   ├── ProtocolMismatch     FAILED_PRECONDITION  412
    │   ├── StaleEpoch           FAILED_PRECONDITION  412
    │   └── TrainingFailed       FAILED_PRECONDITION  412
    ├── ResourceExhausted        RESOURCE_EXHAUSTED   413
    ├── DeadlineExceeded         DEADLINE_EXCEEDED    504
    ├── Unauthenticated          UNAUTHENTICATED      401
    ├── PermissionDenied         PERMISSION_DENIED    403
    ├── Unavailable              UNAVAILABLE          503
    └── Internal                 INTERNAL             500

Raise the most specific class with a message a user can act on; wrap foreign
exceptions with ``raise X(...) from exc``.
"""

from __future__ import annotations

from typing import Any

import grpc

__all__ = [
    "AlreadyExists",
    "ConfigError",
    "DeadlineExceeded",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "MalformedMessage",
    "NotFound",
    "PermissionDenied",
    "PersimmonError",
    "ProtocolMismatch",
    "ResourceExhausted",
    "StaleEpoch",
    "TrainingFailed",
    "Unauthenticated",
    "Unavailable",
    "WrongShard",
    "error_from_grpc",
    "error_from_http",
    "error_named",
]


class PersimmonError(Exception):
    """Base of every error Persimmon raises on purpose."""

    grpc_code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    http_status: int = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(PersimmonError):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400


class MalformedMessage(InvalidArgument):
    """A message that cannot be decoded: bad msgpack, bad array header, truncated buffer."""


class WrongShard(InvalidArgument):
    """Ids sent to a shard that does not own them."""


class ConfigError(InvalidArgument):
    """A configuration value or key that is not accepted."""


class NotFound(PersimmonError):
    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class AlreadyExists(PersimmonError):
    grpc_code = grpc.StatusCode.ALREADY_EXISTS
    http_status = 409


class FailedPrecondition(PersimmonError):
    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 412


class ProtocolMismatch(FailedPrecondition):
    """The peer speaks another protocol version."""


class StaleEpoch(FailedPrecondition):
    """A push of another epoch than its shard's: sent before the shard's last restore (or a
    restart from a checkpoint); nothing was applied. Not retried: re-sync or restart."""


class TrainingFailed(FailedPrecondition):
    """Training gave no result to report: it consumed no valid record, its loss is NaN, or
    its evaluation set is empty or holds one class only (AUC undefined)."""


class ResourceExhausted(PersimmonError):
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 413


class DeadlineExceeded(PersimmonError):
    """A call ran past its deadline; the server did not apply it."""

    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504


class Unauthenticated(PersimmonError):
    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401


class PermissionDenied(PersimmonError):
    grpc_code = grpc.StatusCode.PERMISSION_DENIED
    http_status = 403


class Unavailable(PersimmonError):
    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class Internal(PersimmonError):
    grpc_code = grpc.StatusCode.INTERNAL
    http_status = 500


_BY_CODE: dict[grpc.StatusCode, type[PersimmonError]] = {
    cls.grpc_code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        ResourceExhausted,
        DeadlineExceeded,
        Unauthenticated,
        PermissionDenied,
        Unavailable,
        Internal,
    )
}


def error_from_grpc(code: grpc.StatusCode, message: str) -> PersimmonError:
    """The Persimmon error for a gRPC status (RESOURCE_EXHAUSTED stays itself, unknown → Internal)."""
    return _BY_CODE.get(code, Internal)(message)


def _by_name(name: Any) -> type[PersimmonError] | None:
    cls = globals().get(name) if isinstance(name, str) and name in __all__ else None
    return cls if isinstance(cls, type) and issubclass(cls, PersimmonError) else None


def error_named(name: str, code: str, message: str) -> PersimmonError:
    """The error a peer reported by class ``name`` and gRPC status ``code`` name: that class
    when it is one of these, else the class of that status; anything else :class:`Internal`."""
    cls = _by_name(name)
    if cls is not None:
        return cls(message)
    return error_from_grpc(grpc.StatusCode.__members__.get(code, grpc.StatusCode.UNKNOWN), message)


_BY_HTTP: dict[int, type[PersimmonError]] = {
    cls.http_status: cls for cls in reversed(list(_BY_CODE.values()))
}


def error_from_http(status: int, body: Any) -> PersimmonError:
    """The Persimmon error for an HTTP error response with a JSON body ``{error, message}``."""
    message = body.get("message", str(body)) if isinstance(body, dict) else str(body)
    cls = _by_name(body.get("error")) if isinstance(body, dict) else None
    if cls is not None and cls.http_status == status:
        return cls(message)
    if status == 422:
        return InvalidArgument(f"{message}: {body.get('detail') if isinstance(body, dict) else ''}")
    return _BY_HTTP.get(status, Internal)(message)
