"""canonical_json writes a plain value (ASCII strings, safe integers, booleans, None, lists, str-keyed
dicts) with the standard library's encoder: these prove its bytes are RFC 8785's (the ``rfc8785``
library's) for every such value, and that any other value still takes rfc8785's path (same bytes or
the same refusal)."""

from __future__ import annotations

from typing import Any

import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from durable_dataflow.core import hashing
from durable_dataflow.core.errors import InputError

SAFE = 2**53 - 1
ascii_text = st.text(st.characters(min_codepoint=0, max_codepoint=0x7F), max_size=12)
any_text = st.text(max_size=8)  # non-ASCII too, surrogates excluded by hypothesis' default alphabet
plain_scalars = st.none() | st.booleans() | st.integers(-SAFE, SAFE) | ascii_text
plain = st.recursive(
    plain_scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(ascii_text, inner, max_size=5),
    max_leaves=40,
)
other_scalars = plain_scalars | any_text | st.floats(allow_nan=False, allow_infinity=False)
mixed = st.recursive(
    other_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=600, deadline=None)
@given(plain)
def test_a_plain_value_takes_the_fast_path_and_gets_rfc8785s_bytes(value: Any) -> None:
    assert hashing._plain(value)
    assert hashing.canonical_json(value) == rfc8785.dumps(value)


@settings(max_examples=400, deadline=None)
@given(mixed)
def test_any_value_gets_rfc8785s_bytes_whichever_path(value: Any) -> None:
    assert hashing.canonical_json(value) == rfc8785.dumps(value)


@pytest.mark.parametrize("value", [
    {"a": "\x00\x1f\x7f\"\\ \b\t\n\f\r"},  # every escape RFC 8785 and the encoder write
    {"b": 1, "a": [True, False, None], "B": {"z": -SAFE, "y": SAFE}, "": ""},
    ("a", 1),  # a tuple is an array to both
    {"é": 1, "e": 2},  # a non-ASCII key: rfc8785's sort (UTF-16 code units)
    {"k": "\U0001f600", "l": "\ue000"},  # above and below the surrogates
    {"f": 1.5, "g": 1e21, "h": -0.0},  # numbers: rfc8785's ECMAScript form
])
def test_pinned_values(value: Any) -> None:
    assert hashing.canonical_json(value) == rfc8785.dumps(value)


@pytest.mark.parametrize("value", [2**53, -(2**53), {"a": [2**60]}, {1: "int key"}, float("nan")])
def test_what_rfc8785_refuses_is_refused_not_encoded(value: Any) -> None:
    """A big integer, a non-string key or NaN is never written by the fast path: rfc8785 refuses it."""
    assert not hashing._plain(value)
    with pytest.raises(InputError, match="cannot be canonicalized"):
        hashing.canonical_json(value)
