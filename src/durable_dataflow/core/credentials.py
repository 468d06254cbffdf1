"""The one list of words that mark a name as a credential's, and the one test against it.

Two rules read it, so they cannot drift apart (a copy that lacks a word leaks that word's values):

- ``core.db.redact_url`` hides the value of every query parameter of a database URL whose name is a
  credential's (``?password=…``, ``sslpassword``, ``?token=…``);
- ``datasources.contract.is_credential_option`` refuses a plain value under such an option name in a
  declared datasource's and a definition's target options: it must be a ``{"secret": NAME}`` reference.

A name is a credential's when it contains one of the words, in any case, anywhere in it. Adding a word
is always safe (one more name is scrubbed or must be a reference); removing one never is.
"""

from __future__ import annotations

# Matched as substrings, so some words are covered by shorter ones ("pass" by itself covers "password"
# and "passwd", "key" covers "api_key"); they are kept so that the list names every word a reader
# searches for. The union of the two lists this one replaced (issue 28): never fewer words.
CREDENTIAL_WORDS = (
    "pass",
    "password",
    "passwd",
    "pwd",
    "dsn",
    "secret",
    "token",
    "credential",
    "key",
    "api_key",
    "apikey",
)


def is_credential_name(name: str) -> bool:
    """Whether a parameter or option of this name holds a credential: it contains a CREDENTIAL_WORDS word."""
    lowered = name.lower()
    return any(word in lowered for word in CREDENTIAL_WORDS)
