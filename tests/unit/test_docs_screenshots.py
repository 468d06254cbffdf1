"""Every page the browser test photographs is in docs/img and shown in docs/operations.md (issue 30, item 4):
a page added to the walk without its picture in the guide, or a picture the walk no longer takes, fails here."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_each_screenshot_of_the_walk_is_in_the_operator_guide() -> None:
    walk = (REPO / "tests" / "acceptance" / "test_browser.py").read_text(encoding="utf-8")
    taken = set(re.findall(r'SCREENSHOTS / "([a-z-]+\.png)"', walk))
    assert len(taken) >= 9, taken
    shown = set(re.findall(r"\]\(img/([a-z-]+\.png)\)", (REPO / "docs" / "operations.md").read_text(encoding="utf-8")))
    stored = {path.name for path in (REPO / "docs" / "img").glob("*.png")}
    assert taken == shown == stored, {"taken": taken, "shown": shown, "stored": stored}
