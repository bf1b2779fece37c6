"""One error tree for all of Rudder.

    RudderError                      (500, the root; a bare one is a bug)
    ├── InvalidRequest               (400) malformed input; ``field`` names what is wrong
    │   ├── SubjectMismatch          a bus payload's ids differ from its subject's (dropped)
    │   ├── ValidationFailed         (422) well-formed but not allowed (range, type, unknown name)
    │   │   └── CapabilityMismatch   (422) a weight needs a cache input a live router lacks
    │   ├── PayloadTooLarge          (413)
    │   ├── UnsupportedMediaType     (415)
    │   ├── RequestTimeout           (408) the request (head or body) did not arrive in time
    │   ├── HeadersTooLarge          (431)
    │   ├── SignatureInvalid         a policy event is unsigned, signed by an unknown key, or its
    │   │                            signature does not verify; ``reason_code`` says which
    │   └── KeyFileInvalid           a signing or verify-keys file is missing, too open or malformed;
    │                                ``field`` names the setting
    ├── Unauthenticated              (401)
    ├── Forbidden                    (403)
    ├── NotFound                     (404)
    ├── MethodNotAllowed             (405) the path exists, the method does not; carries ``allow``
    ├── RevisionConflict             (409) carries expected_revision and head_revision
    ├── ServiceUnavailable           (503) carries retry_after
    │   ├── AuditUnavailable         (503) the audit store could not record: nothing happens
    │   ├── DecisionUnrecorded       (503) published (the change IS live, ``new_revision``) but its
    │   │                            decision could not be recorded (the reconciler records it)
    │   └── LogUnavailable           (503) NATS/JetStream did not answer, or refused: nothing stored
    │       └── LogAmbiguous         (503) a publish whose outcome is unknown (the reconciler decides)
    ├── Overloaded                   (529 by default, configurable) every eligible worker is busy
    │   └── QueueFull                (529) the router's selection queue is at its bound
    ├── RateLimited                  (429) carries retry_after (failed authentications of one source)
    ├── ClientGone                   (499)
    └── ConfigurationError           (start-up) a missing or bad setting; ``field`` names it

Each class carries its HTTP status as ``status_code`` and its facts as attributes; every API
renders its body from ``to_dict()`` in one place (the admin API in the Rudder shape, the router in
the OpenAI shape). Outside errors (nats, asyncpg, httpx) are translated at the adapter that calls
them, with ``raise ... from exc``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


class RudderError(Exception):
    status_code: int = 500
    code: str = "internal_error"

    def __init__(self, message: str, *, field: str | None = None, **facts: Any) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.facts: dict[str, Any] = facts

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.field is not None:
            body["field"] = self.field
        body.update(self.facts)
        return body

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, field={self.field!r}, facts={self.facts!r})"


class InvalidRequest(RudderError):
    status_code = 400
    code = "invalid_request"


class SubjectMismatch(InvalidRequest):
    """A bus payload names other ids than the subject (or KV key) it was published on: a process
    speaking for someone else. Carries ``subject`` and, in ``field``, the payload field."""

    code = "subject_mismatch"


class ValidationFailed(InvalidRequest):
    status_code = 422
    code = "validation_failed"


class CapabilityMismatch(ValidationFailed):
    code = "capability_mismatch"


class PayloadTooLarge(InvalidRequest):
    status_code = 413
    code = "payload_too_large"


class UnsupportedMediaType(InvalidRequest):
    status_code = 415
    code = "unsupported_media_type"


class RequestTimeout(InvalidRequest):
    status_code = 408
    code = "request_timeout"


class HeadersTooLarge(InvalidRequest):
    status_code = 431
    code = "headers_too_large"


class SignatureInvalid(InvalidRequest):
    """A policy event that does not carry a valid signature by a configured key (DESIGN §9).

    ``reason_code`` is one of ``signature_missing``, ``signature_unknown_key``,
    ``signature_invalid``; routers put it first in their NACK detail."""

    code = "signature_invalid"

    def __init__(self, message: str, *, reason_code: str, key_id: str | None = None) -> None:
        super().__init__(message, reason_code=reason_code, key_id=key_id)
        self.reason_code = reason_code
        self.key_id = key_id


class KeyFileInvalid(InvalidRequest):
    code = "key_file_invalid"


class Unauthenticated(RudderError):
    status_code = 401
    code = "unauthenticated"


class Forbidden(RudderError):
    status_code = 403
    code = "forbidden"


class NotFound(RudderError):
    status_code = 404
    code = "not_found"


class MethodNotAllowed(RudderError):
    """The path is served, not with this method. ``allow`` lists the methods it takes (also sent
    as the ``Allow`` header)."""

    status_code = 405
    code = "method_not_allowed"

    def __init__(self, message: str, *, allow: list[str], **facts: Any) -> None:
        super().__init__(message, allow=allow, **facts)
        self.allow = allow


class RevisionConflict(RudderError):
    """A compare-and-set failed: the caller's ``expected_revision`` is not the head."""

    status_code = 409
    code = "revision_conflict"

    def __init__(
        self, message: str, *, expected_revision: int | None, head_revision: int, **facts: Any
    ) -> None:
        super().__init__(
            message, expected_revision=expected_revision, head_revision=head_revision, **facts
        )
        self.expected_revision = expected_revision
        self.head_revision = head_revision


class ServiceUnavailable(RudderError):
    status_code = 503
    code = "service_unavailable"

    def __init__(self, message: str, *, retry_after: int = 1, **facts: Any) -> None:
        super().__init__(message, retry_after=retry_after, **facts)
        self.retry_after = retry_after


class AuditUnavailable(ServiceUnavailable):
    code = "audit_unavailable"


class DecisionUnrecorded(ServiceUnavailable):
    """The event was published (``new_revision``: the change is live) but the audit store could
    not record its decision; the reconciler records it from the stream (or the ACKs) later.
    Unlike ``audit_unavailable`` (nothing published), a client must not retry blindly."""

    code = "decision_unrecorded"


class LogUnavailable(ServiceUnavailable):
    code = "log_unavailable"


class LogAmbiguous(LogUnavailable):
    """The publish may or may not have been stored; a reconciler must decide later."""

    code = "log_ambiguous"


class Overloaded(RudderError):
    status_code = 529
    code = "overloaded"


class QueueFull(Overloaded):
    """Refused before queueing: the scheduler already holds its bound of waiting selections."""

    code = "queue_full"


class RateLimited(RudderError):
    status_code = 429
    code = "rate_limited"

    def __init__(self, message: str, *, retry_after: int = 1, **facts: Any) -> None:
        super().__init__(message, retry_after=retry_after, **facts)
        self.retry_after = retry_after


class ClientGone(RudderError):
    status_code = 499
    code = "client_gone"


class ConfigurationError(RudderError):
    """A process cannot start: a setting is missing or wrong (``field`` names the setting), or
    what the bus offers differs from what it relies on (a stream's settings)."""

    code = "configuration_error"


def error_json(payload: Mapping[str, Any]) -> bytes:
    """An error answer's JSON body, ASCII only (anything else as ``\\u`` escapes, which every JSON
    reader takes back). A message may quote a client's text, and a client's JSON may hold a lone
    surrogate (``"\\ud800"``) that UTF-8 cannot encode: the refusal must still render."""
    return json.dumps(payload, ensure_ascii=True, separators=(",", ":")).encode("ascii")
