"""core.text.printable: which characters it replaces, checked against Unicode itself."""

from __future__ import annotations

import sys
import unicodedata

from durable_dataflow.core import text


def test_the_controls_replaced_are_category_cc_plus_bidi_and_separators() -> None:
    """Proves the fixed C0/DEL/C1 set is every code point of category Cc in this Python's Unicode
    database, and that printable escapes exactly those, the bidi controls and the line separators."""
    cc = {code for code in range(sys.maxunicode + 1) if unicodedata.category(chr(code)) == "Cc"}
    assert cc == text.CC_CONTROLS
    replaced = {
        code
        for code in range(sys.maxunicode + 1)
        if not 0xD800 <= code <= 0xDFFF and text.printable(chr(code), multiline=False) != chr(code)
    }
    assert replaced == cc | text.BIDI_CONTROLS | text.LINE_SEPARATORS


def test_multiline_keeps_tab_and_newline_and_escapes_the_rest() -> None:
    """Proves the two forms differ only in tab and newline, and that each escape is visible ASCII."""
    sample = "a\tb\nc\rd\x1b[2Je\x7f\u0085\u202eF\u2028"
    assert text.printable(sample) == "a\tb\nc\\x0dd\\x1b[2Je\\x7f\\x85\\u202eF\\u2028"
    assert text.printable(sample, multiline=False) == "a\\x09b\\x0ac\\x0dd\\x1b[2Je\\x7f\\x85\\u202eF\\u2028"
    assert text.printable("Zürich 🌍") == "Zürich 🌍"
