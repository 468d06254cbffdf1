"""What a PostgreSQL driver error may say once it leaves a source or a sink: a fixed description.

After connecting, a server message quotes values (a cast error prints the text it could not
convert, a DETAIL prints a row), and libpq's connection errors quote host names, ports and
segments of the connection string (a malformed DSN's password among them). So no driver text ever
leaves: a message is a fixed description chosen by SQLSTATE, followed by that SQLSTATE; a failure
with no SQLSTATE (before a session exists, or in the client) gets a fixed description of its kind.
The driver text is only *matched* to choose among the fixed descriptions, never copied.
"""

from __future__ import annotations

import re

QUERY_CANCELED = "57014"  # SQLSTATE of statement_timeout and of a cancel request
SQLSTATE_PATTERN = re.compile(r"^[0-9A-Z]{5}$")

# SQLSTATEs worth their own words; every other code is described by its class (the first two characters).
_BY_SQLSTATE: dict[str, str] = {
    "0A000": "the statement uses a feature that is not allowed here (e.g. a data-modifying statement in a cursor)",
    "22003": "a number is out of range for its type",
    "22012": "a division by zero",
    "22P02": "a value has the wrong form for its type (invalid input syntax)",
    "25001": "the statement tried to change the transaction's mode after it began",
    "25006": "the statement tried to write, which the read-only session forbids",
    "25P03": "the session stayed idle inside its transaction past the time limit",
    "42501": "the role lacks a privilege the statement needs",
    "42601": "the statement has a syntax error or is more than one statement",
    "42703": "the statement names a column that does not exist",
    "42883": "the statement calls a function or operator that does not exist for these argument types",
    "42P01": "the statement names a table or view that does not exist",
    "55P03": "a lock the statement needs is held by another session (lock_timeout)",
    QUERY_CANCELED: "the statement was canceled (its time limit ran out)",
}
_BY_CLASS: dict[str, str] = {
    "08": "the connection to the server failed",
    "0A": "the statement uses a feature the server does not support",
    "22": "a value could not be converted or computed (data exception)",
    "23": "the rows violate a constraint of the table",
    "25": "the statement is not allowed in this transaction",
    "28": "the server refused the credentials",
    "3D": "the database does not exist",
    "40": "the server rolled the transaction back (serialization failure or deadlock)",
    "42": "the statement has a syntax error, names an unknown object or lacks a privilege",
    "53": "the server ran out of a resource (memory, disk or connections)",
    "54": "the statement exceeds a server limit",
    "55": "an object the statement needs is not in the required state",
    "57": "the server canceled the statement or is shutting down",
    "58": "the server hit a system error",
    "P0": "a function raised an error",
    "XX": "the server hit an internal error",
}
_SERVER_ERROR = "the server reported an error"

# Connection failures carry no SQLSTATE in psycopg; the (English) libpq or server text picks one of
# these descriptions, first match wins. Unmatched text (another locale) gets the generic one.
_CONNECT_FAILURES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), description)
    for pattern, description in (
        (r"password authentication failed|authentication failed|no pg_hba\.conf entry|password is required"
         r"|no password supplied|role \S+ does not exist", "the server refused the credentials (authentication)"),
        (r"database \S+ does not exist", "the database does not exist"),
        (r"invalid value for parameter|unrecognized configuration parameter|cannot be changed"
         r"|permission denied to set parameter", "the server refused a session option"),
        (r"too many (clients|connections)|remaining connection slots", "the server has no free connection slot"),
        (r"database system is (starting up|shutting down|in recovery)|not yet accepting connections",
         "the server does not accept connections now"),
        (r"invalid port|servname not supported|invalid integer value|invalid \S+ value",
         "a connection parameter has an invalid value"),
        (r"could not translate host name|failed to resolve host|name or service not known",
         "the host name does not resolve"),
        (r"timeout expired|timed out", "the connection timed out"),
        (r"connection refused|no such file or directory", "nothing accepts connections at that address"),
        (r"ssl|gssapi|certificate", "the TLS or GSSAPI negotiation failed"),
    )
)  # fmt: skip
_CONNECT_FAILED = "the connection attempt failed"
INVALID_CONNINFO = "it is not a valid PostgreSQL connection string (conninfo)"


def sqlstate_of(exc: BaseException) -> str | None:
    """The exception's SQLSTATE when it carries a well-formed one."""
    sqlstate = getattr(exc, "sqlstate", None)
    return sqlstate if isinstance(sqlstate, str) and SQLSTATE_PATTERN.match(sqlstate) else None


def describe(exc: BaseException) -> str:
    """'<fixed description> (SQLSTATE xxxxx)' for a server error; a fixed description of its kind otherwise."""
    sqlstate = sqlstate_of(exc)
    if sqlstate is not None:
        text = _BY_SQLSTATE.get(sqlstate) or _BY_CLASS.get(sqlstate[:2], _SERVER_ERROR)
        return f"{text} (SQLSTATE {sqlstate})"
    import psycopg  # only a run with a PostgreSQL source or sink gets here: the driver loads lazily

    if isinstance(exc, psycopg.OperationalError):
        return "the connection to the server failed or was lost (no SQLSTATE)"
    return f"the driver reported {type(exc).__name__} (no SQLSTATE)"


def is_valid_conninfo(dsn: str) -> bool:
    """Whether libpq can parse the DSN (a keyword/value string or a postgresql:// URI)."""
    import psycopg

    try:
        psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.Error:
        return False
    return True


def describe_connect(exc: BaseException, dsn: str) -> str:
    """A fixed description of why connecting with ``dsn`` failed; neither the DSN nor the driver text."""
    if not is_valid_conninfo(dsn):
        return INVALID_CONNINFO
    if sqlstate_of(exc) is not None:
        return describe(exc)
    text = str(exc)
    for pattern, description in _CONNECT_FAILURES:
        if pattern.search(text):
            return description
    return _CONNECT_FAILED
