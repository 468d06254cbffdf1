"""A real browser against a real `dataflow serve`: an operator logs in, sees the unresolved warning on
the history page, opens the run, reconciles it, and sees the finding. Screenshots go to docs/img/.

Headless Chromium is Debian's `chromium` package (scripts/install-system-deps.sh), driven by the
`playwright` Python package through `executable_path`: no browser is downloaded.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from durable_dataflow.api import tokens
from durable_dataflow.dataflow.protocol import sweeper
from durable_dataflow.platform import Platform
from support.api_runs import copy_examples

REPO = Path(__file__).resolve().parents[2]
# `make screenshots` refreshes docs/img; a plain test run keeps the tracked images untouched.
SCREENSHOTS = Path(os.environ.get("DATAFLOW_SCREENSHOT_DIR", REPO / "test-artifacts" / "screenshots"))
CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
CHROMIUM_ARGS = [
    "--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]  # fmt: skip
STARTUP_LINES_MAX = 200
PAGE_TIMEOUT_MS = 30_000
LISTENING = re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)")

pytestmark = pytest.mark.browser


def _chromium() -> str:
    for candidate in CHROMIUM_CANDIDATES:
        if os.access(candidate, os.X_OK):
            return candidate
    message = "chromium is not installed (scripts/install-system-deps.sh installs it)"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def _dataflow_command() -> list[str]:
    installed = Path(sys.executable).with_name("dataflow")
    return [str(installed)] if installed.exists() else [sys.executable, "-m", "durable_dataflow.cli"]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, str, str]]:
    """`dataflow serve` on a free loopback port over a demo database plus a crashed, swept publication run."""
    url = f"sqlite:///{tmp_path}/dataflow.db"
    examples = copy_examples(tmp_path)
    cli = [*_dataflow_command(), "--db", url]
    # What `make demo` leaves behind: one atomic run, recorded by the real CLI.
    demo = [*cli, "run", str(examples / "revenue_by_region" / "dataflow.yaml"), "--param", "day=2026-11-02"]
    subprocess.run(demo, check=True, capture_output=True, timeout=120)
    # A forward-recovery run whose process is SIGKILLed right after the provider call returned.
    crash_env = {**os.environ, "DATAFLOW_CRASH_AT": "after_provider_call", "DATAFLOW_LEASE_TTL": "5"}
    publish = [*cli, "run", str(examples / "daily_orders_publish" / "dataflow.yaml"), "--param", "day=2026-11-02"]
    crashed = subprocess.run(publish, env=crash_env, capture_output=True, timeout=120)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    with Platform(url) as platform:
        platform.db.advance_clock(60)  # past the lease expiry, on this object's database clock only
        decisions = sweeper.sweep(platform.db)
        assert [d.decision for d in decisions] == ["outcome_unknown"], decisions
        unknown = platform.runs.get(decisions[0].run_id)
        token = tokens.create_token(platform.db, "default", "operator", "demo-operator")[0]
    # Its schedule applied, and a backfill of two days run by a worker: the schedules and backfill pages.
    daily = str(examples / "daily_orders_publish" / "dataflow.yaml")
    steps = (
        ["schedules", "apply", daily],
        ["backfill", "submit", daily, "--from", "2026-11-03", "--to", "2026-11-04"],
        ["worker", "--until-idle", "--poll-interval", "0.1"],
        # Two days of a partitioned Delta table: the partitions page.
        ["run", str(examples / "daily_orders_publish" / "daily_table.yaml"), "-p", "day=2026-11-02"],
        ["run", str(examples / "daily_orders_publish" / "daily_table.yaml"), "-p", "day=2026-11-03"],
    )
    for step in steps:
        done = subprocess.run([*cli, *step], capture_output=True, timeout=120, text=True)
        assert done.returncode == 0, (step, done.stdout, done.stderr)
    process = subprocess.Popen(
        [*_dataflow_command(), "--db", url, "serve", "--host", "127.0.0.1", "--port", "0"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stderr is not None
    try:
        base = None
        for _ in range(STARTUP_LINES_MAX):  # uvicorn logs its bound port once it listens
            line = process.stderr.readline()
            if not line:
                break
            if found := LISTENING.search(line):
                base = found.group(1)
                break
        assert base is not None, f"dataflow serve did not start (exit {process.poll()})"
        yield base, token, unknown.run_id
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stderr.close()


def test_operator_sees_the_warning_and_reconciles_in_a_browser(server: tuple[str, str, str]) -> None:
    """Log in, find the role=alert warning for the outcome_unknown run and the activity charts, open the run
    (its timeline), press Reconcile, see 'present'; filter the history, walk schedules → backfill → a day's
    run → API reference → a partitioned run's partitions → Ops."""
    from playwright.sync_api import expect, sync_playwright

    base, token, run_id = server
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(PAGE_TIMEOUT_MS)
            page.goto(f"{base}/ui/runs")
            expect(page).to_have_url(re.compile(r"/ui/login$"))  # no session: the login form
            page.screenshot(path=str(SCREENSHOTS / "login.png"), full_page=False)
            page.get_by_label("API token").fill(token)
            page.get_by_role("button", name="Log in").click()
            expect(page).to_have_url(re.compile(r"/ui/runs$"))

            warning = page.get_by_role("alert").filter(has_text=run_id)
            expect(warning).to_be_visible()
            expect(warning).to_contain_text("external output may exist")
            # The sink key derives from the tenant and the run's idempotency key (forward.publication_key).
            expect(warning).to_contain_text(re.compile(r"dataflow/default/key/[0-9a-f]{64}"))
            expect(warning).not_to_contain_text("failed")
            # The activity charts: today's runs by outcome (one of them unresolved), durations per definition.
            expect(page.locator("figure.chart-outcomes > svg rect.bar-unresolved")).to_have_count(1)
            expect(page.locator("figure.chart-durations")).to_contain_text("daily_orders_by_day")
            page.screenshot(path=str(SCREENSHOTS / "history.png"), full_page=True)

            page.get_by_role("link", name="Ops ledger").click()
            expect(page.get_by_role("heading", name="Unresolved runs: 1")).to_be_visible()
            expect(page.locator("figure.chart-trouble > svg rect.bar-unresolved")).to_have_count(1)
            page.screenshot(path=str(SCREENSHOTS / "ops.png"), full_page=True)

            page.get_by_role("link", name=run_id).first.click()
            expect(page.get_by_role("heading", name="Ledger timeline")).to_be_visible()
            expect(page.get_by_text("The evidence chain verifies")).to_be_visible()
            # The timeline on a time axis: a dot per ledger entry, as many as the entries table has rows.
            timeline = page.locator("figure.chart-timeline > svg")
            expect(timeline).to_be_visible()
            entries = page.locator("table.timeline tbody tr").count()
            expect(timeline.locator("circle")).to_have_count(entries)
            page.screenshot(path=str(SCREENSHOTS / "run-unresolved.png"), full_page=True)

            page.get_by_role("button", name="Reconcile").click()
            expect(page.get_by_role("status")).to_contain_text("Reconciliation result: present")
            expect(page.get_by_text("reconciled_present").first).to_be_visible()
            page.screenshot(path=str(SCREENSHOTS / "run-reconciled.png"), full_page=True)

            page.get_by_role("link", name="Run history").click()
            expect(page.get_by_role("alert").filter(has_text=run_id)).to_have_count(0)
            # Filter by definition and parameter: exactly the backfill's run of that day.
            page.get_by_label("Definition", exact=True).fill("daily_orders_publish")
            page.get_by_label("Parameter", exact=True).fill("day=2026-11-03")
            page.get_by_role("button", name="Filter").click()
            expect(page).to_have_url(re.compile(r"param=day%3D2026-11-03"))
            listed = page.locator("table.runs tbody tr")
            expect(listed).to_have_count(1)
            expect(listed).to_contain_text("day=2026-11-03")

            page.get_by_role("link", name="Schedules").click()
            expect(page.get_by_role("heading", name="Backfills")).to_be_visible()
            backfills = page.locator("table.backfills")
            expect(backfills).to_contain_text("daily_orders_publish")
            expect(backfills).to_contain_text("2/2")
            page.screenshot(path=str(SCREENSHOTS / "schedules.png"), full_page=True)

            backfills.get_by_role("link", name="daily_orders_publish").click()
            expect(page.get_by_role("heading", name="Backfill of daily_orders_publish")).to_be_visible()
            expect(page.get_by_text("2 of 2 days finished")).to_be_visible()
            page.screenshot(path=str(SCREENSHOTS / "backfill.png"), full_page=True)
            page.locator("table.backfill-days a[href^='/ui/runs/']").first.click()
            expect(page.get_by_role("heading", name="Ledger timeline")).to_be_visible()

            page.get_by_role("link", name="API reference").click()
            expect(page.get_by_text("OAS 3.1")).to_be_visible()
            page.screenshot(path=str(SCREENSHOTS / "api-reference.png"), full_page=False)

            # A partitioned run's page leads to its datasource's partitions: both days published.
            page.goto(f"{base}/ui/runs?definition=daily_orders_by_day")
            page.locator("table.runs a[href^='/ui/runs/']").first.click()
            page.get_by_role("link", name="its partitions").click()
            expect(page.get_by_role("heading", name=re.compile("analytics.daily_revenue_by_day"))).to_be_visible()
            expect(page.locator("td.cell-published")).to_have_count(2)
            page.screenshot(path=str(SCREENSHOTS / "partitions.png"), full_page=True)

            # Back to the Ops page: nothing unresolved after the reconciliation, and the chart says so.
            page.get_by_role("link", name="Ops ledger").click()
            expect(page.get_by_role("heading", name="Unresolved runs: 0")).to_be_visible()
            expect(page.locator("figure.chart-trouble > svg rect.bar-unresolved")).to_have_count(0)
        finally:
            browser.close()
