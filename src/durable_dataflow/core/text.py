"""Text a submitter chose, made safe to show on a terminal or a web page.

Parameters, definition names, idempotency keys and error messages come from whoever submitted a run,
and an operator later reads them in ``dataflow show`` or on ``/ui``. Raw, they could carry terminal
escape sequences (``\\x1b[2J`` clears the screen, OSC 8 forges links, OSC 52 writes the clipboard),
carriage returns that overwrite what an operator reads, or bidirectional overrides that make text
read differently from what it is (CVE-2021-42574, "Trojan Source"). :func:`printable` replaces each
such character with a visible escape, so the operator sees that it was there and what it was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only a settings file's validation needs pydantic
    from pydantic import ValidationError

# Unicode's bidirectional controls: marks, embeddings, overrides and isolates (UAX #9).
BIDI_CONTROLS = frozenset({0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)})
# The line and paragraph separators end a line in some terminals and editors, like a newline does.
LINE_SEPARATORS = frozenset({0x2028, 0x2029})
# What `multiline` text keeps: a tab and a newline only ever move the cursor forward or down.
LAYOUT_CONTROLS = frozenset({ord("\t"), ord("\n")})
# Unicode's category Cc ("control") is exactly C0 (U+0000-U+001F), DEL (U+007F) and C1
# (U+0080-U+009F), fixed by the standard (tests/unit/test_text.py checks it against unicodedata).
CC_CONTROLS = frozenset({*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)})


def _escape(code: int) -> str:
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


_CONTROL_CODES = tuple(sorted(CC_CONTROLS | BIDI_CONTROLS | LINE_SEPARATORS))
_ESCAPES_ONE_LINE = {code: _escape(code) for code in _CONTROL_CODES}
_ESCAPES_MULTILINE = {code: text for code, text in _ESCAPES_ONE_LINE.items() if code not in LAYOUT_CONTROLS}


def printable(text: str, *, multiline: bool = True) -> str:
    """``text`` with every control character written as a visible escape (``\\x1b``, ``\\u202e``).

    Replaced: the C0 controls, DEL, the C1 controls, the bidirectional controls and the line and
    paragraph separators. ``multiline`` keeps tab and newline (right for a page, where HTML folds
    them, and for a multi-line message); ``multiline=False`` escapes them too, for a value shown in
    one table cell or one line of a terminal. Everything else, non-ASCII letters and emoji included,
    is kept as it is. The result never contains a character that :func:`printable` would replace,
    and printable text is returned unchanged.
    """
    return text.translate(_ESCAPES_MULTILINE if multiline else _ESCAPES_ONE_LINE)


# A key of a settings file shown in an error: one line, at most this many characters of it.
SHOWN_KEY_CHARS_MAX = 64


def validation_problems(error: ValidationError, *, most: int = 5) -> str:
    """A settings file's validation errors (pydantic's) on one line: each one's path and message, never a
    value. A path names the file's keys, which the file's author wrote: each is shown on one line
    (control characters escaped) and at most ``SHOWN_KEY_CHARS_MAX`` characters long."""

    def shown(part: object) -> str:
        text = printable(str(part), multiline=False)
        return text if len(text) <= SHOWN_KEY_CHARS_MAX else text[:SHOWN_KEY_CHARS_MAX] + "…"

    return "; ".join(".".join(shown(p) for p in e["loc"]) + ": " + e["msg"] for e in error.errors()[:most])
