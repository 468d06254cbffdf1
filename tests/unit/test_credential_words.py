"""One credential-word list for both security rules (issue 28, item 6): the DSN scrubber and the options check.

``core.credentials.CREDENTIAL_WORDS`` is the one list. ``core.db.redact_url`` hides a query parameter
whose name holds one of its words; a definition's target options and a declared datasource's options
(``datasources.contract.is_credential_option``) refuse a plain value under such a name. Two copies
of this rule drifted before (``apikey`` was refused by one path and not the other; ``dsn`` was an
option word but not a URL parameter word): these tests fail if a caller stops reading the one list.
"""

from __future__ import annotations

from collections.abc import Iterator

import pydantic
import pytest

from durable_dataflow import migrations
from durable_dataflow.core import credentials
from durable_dataflow.core.db import Database, redact_url
from durable_dataflow.core.errors import InputError
from durable_dataflow.dataflow.definitions import definitions
from durable_dataflow.datasources import contract, registry

SECRET = "s3cr3t-Pw"
# The two lists the one list replaced: it must hold every word of both (never fewer: a security rule).
FORMER_URL_PARAMETER_WORDS = ("pass", "pwd", "secret", "token", "credential", "key")
FORMER_OPTION_WORDS = ("password", "passwd", "dsn", "secret", "token", "credential", "api_key", "apikey")
NEW_WORD = "zebra"  # not a credential word: added to the one list by a test to see both callers follow it


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Database]:
    """A migrated SQLite database in a temporary directory, one for the module (nothing is ever registered)."""
    database = Database(f"sqlite:///{tmp_path_factory.mktemp('credentials')}/dataflow.db")
    migrations.upgrade(database)
    yield database
    database.dispose()


def _names(word: str) -> list[str]:
    """Names that hold ``word``: alone, in upper case, and inside a longer name."""
    return [word, word.upper(), f"db_{word}_2"]


def _assert_both_rules_hold(db: Database, name: str) -> None:
    """The scrubber hides a query parameter called ``name``; both options checks refuse a plain value under it."""
    redacted = redact_url(f"postgresql://alice@db.example:5432/app?{name}={SECRET}&sslmode=require")
    assert SECRET not in redacted and "sslmode=require" in redacted, redacted
    assert contract.is_credential_option(name)
    with pytest.raises(pydantic.ValidationError, match="looks like a credential"):
        definitions.TargetSpec.model_validate(
            {"type": "datasources.publication", "provider": "postgres", "datasource": "d", "location": "t",
             "options": {name: SECRET}}
        )  # fmt: skip
    with db.begin() as conn, pytest.raises(InputError, match="looks like a credential"):
        registry.register_datasource(conn, "x", "postgres", "t", {name: SECRET})


def test_the_one_list_holds_every_word_of_the_two_it_replaced() -> None:
    """Proves no word was lost when the scrubber's and the options check's lists became one, by set inclusion."""
    assert set(FORMER_URL_PARAMETER_WORDS) | set(FORMER_OPTION_WORDS) <= set(credentials.CREDENTIAL_WORDS)


@pytest.mark.parametrize("word", credentials.CREDENTIAL_WORDS)
def test_every_word_is_scrubbed_from_a_url_and_refused_as_an_option(db: Database, word: str) -> None:
    """Proves each word of the one list is hidden by redact_url and refused by both options checks, in any case
    and inside a longer name, by calling the three paths with names made of it."""
    for name in _names(word):
        _assert_both_rules_hold(db, name)


def test_both_callers_read_the_one_list(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """Proves the scrubber and the options checks keep no copy of their own: a word added to
    core.credentials.CREDENTIAL_WORDS alone is at once scrubbed and refused by all of them."""
    name = f"my_{NEW_WORD}"
    assert SECRET in redact_url(f"postgresql://alice@db.example/app?{name}={SECRET}")
    assert not contract.is_credential_option(name)
    monkeypatch.setattr(credentials, "CREDENTIAL_WORDS", (*credentials.CREDENTIAL_WORDS, NEW_WORD))
    _assert_both_rules_hold(db, name)


def test_a_name_without_a_credential_word_is_neither_scrubbed_nor_refused() -> None:
    """Proves the rule neither hides what locates the database nor refuses ordinary options (sslmode, batch_size)."""
    assert redact_url("postgresql://alice@db.example/app?sslmode=require") == (
        "postgresql://alice@db.example/app?sslmode=require"
    )
    assert not contract.is_credential_option("batch_size")
