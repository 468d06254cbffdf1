"""The one exception root of Durable Dataflow, with a stable code per subclass.

The CLI and the API map codes to exit statuses and HTTP answers in one table each. Driver errors
are translated once, at the storage boundary, into these classes.
"""

from __future__ import annotations


class DataflowError(Exception):
    """Root of every error this platform raises on purpose. `code` is stable and documented."""

    code = "error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InputError(DataflowError):
    """Bad input: a malformed definition, a wrong parameter type, hostile SQL, a path outside its root."""

    code = "invalid_input"


class NotFound(DataflowError):
    """The named run, definition, datasource or token does not exist (or is not visible to the caller)."""

    code = "not_found"


class Conflict(DataflowError):
    """The request contradicts recorded state, e.g. the same idempotency key with another request."""

    code = "conflict"


class StaleAttempt(DataflowError):
    """A write for an attempt that is no longer current, or whose lease expired (the fence refused it)."""

    code = "stale_attempt"


class LeaseUnavailable(DataflowError):
    """A lease could not be acquired because another holder's lease is live."""

    code = "lease_unavailable"


class EvidenceError(DataflowError):
    """The evidence chain or the facts required for a state did not verify; nothing was committed."""

    code = "evidence_failed"


class StorageUnavailable(DataflowError):
    """The platform database could not be reached or lost the connection mid-operation."""

    code = "storage_unavailable"


class ExecutionError(DataflowError):
    """A dataflow step or source failed at execution time (not a protocol failure)."""

    code = "execution_failed"


class LimitExceeded(ExecutionError):
    """A declared or configured limit was hit: rows, bytes, time or memory. The message names the limit."""

    code = "limit_exceeded"


class PermissionDenied(DataflowError):
    """The caller is authenticated but lacks the role for this action."""

    code = "permission_denied"


class Unauthenticated(DataflowError):
    """No valid credential was presented."""

    code = "unauthenticated"


class Interrupted(DataflowError):
    """The process was told to stop (SIGINT, SIGTERM) while it executed: not a failure of the run.
    Before dispatch authorization the run is cancelled (dataflow.protocol.cancel.interrupt)."""

    code = "interrupted"


class QuotaExceeded(DataflowError):
    """A tenant's quota (or the platform's inline execution capacity) refused the request before anything
    was recorded. ``quota`` names it, ``limit`` is its value, ``retry_after_s`` when to try again (the API
    sends it as ``Retry-After``). The message names the caller's own usage only, never another tenant's."""

    code = "quota_exceeded"

    def __init__(self, message: str, *, quota: str, limit: int, retry_after_s: int) -> None:
        super().__init__(message)
        self.quota = quota
        self.limit = limit
        self.retry_after_s = retry_after_s
