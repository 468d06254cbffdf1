"""The remote CLI on SQLite and PostgreSQL (issue 33 item 5): `dataflow --api URL` runs `run`, `runs`,
`reconcile` and `cancel` against a real HTTP server (uvicorn in a thread, over a socket) with the token
from DATAFLOW_TOKEN or --token-file, printing what the local command prints over --db and exiting with its
status; a local-only command, --api with --db and a world-readable token file exit 2; the token is never
in argv, the output or an error."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from durable_dataflow import cli
from durable_dataflow.api import tokens
from durable_dataflow.api.app import create_app
from durable_dataflow.cli import remote
from durable_dataflow.platform import Platform
from support.api_runs import copy_examples, make_outcome_unknown_run, make_queued_run, tenant_data_root
from support.cli import SCRUBBED_ENV

SERVER_START_S = 30.0
SERVER_POLL_S = 0.05
DERIVED_EACH_READ = ("age_s",)  # the run's age counts on the clock of each read


@dataclass(frozen=True)
class Served:
    platform: Platform
    url: str
    operator_token: str
    platform_token: str
    db_url: str
    examples: Path


@contextlib.contextmanager
def serving(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tenants: tuple[str, ...] = ("acme",)
) -> Iterator[Served]:
    """A real server over a socket whose tenants' data roots hold the revenue example's data; an acme
    operator token and a platform token (tests/integration/test_cli_remote_more.py serves with it too)."""
    for name in (*SCRUBBED_ENV, remote.API_URL_VARIABLE, remote.TOKEN_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    platform = Platform(db_url)
    examples = copy_examples(tmp_path)
    app = create_app(platform, data_root=tenant_data_root(tmp_path, examples, tenants), sink_root=tmp_path / "sinks")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + SERVER_START_S
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the API server did not start"
        time.sleep(SERVER_POLL_S)  # polling a condition with a deadline, not waiting for an order
    operator = tokens.create_token(platform.db, "acme", "operator", "acme-operator")[0]
    platform_token = tokens.create_platform_token(platform.db, "oncall")[0]
    try:
        yield Served(platform, f"http://127.0.0.1:{listener.getsockname()[1]}", operator, platform_token, db_url,
                     examples)  # fmt: skip
    finally:
        server.should_exit = True
        thread.join(SERVER_START_S)
        listener.close()
        platform.close()


@pytest.fixture
def served(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    """A real server over a socket for tenant acme (data root holding the revenue example's data)."""
    with serving(db_url, tmp_path, monkeypatch) as found:
        yield found


@dataclass(frozen=True)
class Said:
    code: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def dataflow(capsys: pytest.CaptureFixture[str], *args: str) -> Said:
    """`dataflow ARGS` in this process (the console script's main), its exit status and output."""
    capsys.readouterr()
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return Said(code, out, err)


def remote_dataflow(
    served: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str, token: str = ""
) -> Said:
    monkeypatch.setenv(remote.TOKEN_VARIABLE, token or served.operator_token)
    try:
        return dataflow(capsys, "--api", served.url, *args)
    finally:
        monkeypatch.delenv(remote.TOKEN_VARIABLE)


def without_age(document: Any) -> Any:
    if isinstance(document, list):
        return [without_age(item) for item in document]
    return {k: v for k, v in document.items() if k not in DERIVED_EACH_READ}


def test_runs_is_the_same_over_the_api(
    served: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`runs --json` over --api equals the local one (but each read's age); the human table lists the same
    runs with the same UNRESOLVED note; a bad --status exits 2 before anything is sent."""
    make_outcome_unknown_run(served.platform, served.examples, "acme", key="unknown")
    make_queued_run(served.platform, served.examples, "acme", key="queued")
    local = dataflow(capsys, "--db", served.db_url, "runs", "--json")
    over_api = remote_dataflow(served, capsys, monkeypatch, "runs", "--json")
    assert (over_api.code, local.code) == (0, 0), over_api.stderr
    assert without_age(json.loads(over_api.stdout)) == without_age(json.loads(local.stdout))
    local_table = dataflow(capsys, "--db", served.db_url, "runs")
    api_table = remote_dataflow(served, capsys, monkeypatch, "runs")
    assert api_table.code == local_table.code == 0
    assert api_table.stdout.splitlines()[-1] == local_table.stdout.splitlines()[-1]  # "1 unresolved run(s): ..."
    for run in json.loads(local.stdout):
        assert run["run_id"][-12:] in api_table.stdout
    bad = remote_dataflow(served, capsys, monkeypatch, "runs", "--status", "nope")
    assert bad.code == 2 and "--status 'nope'" in bad.stderr


def test_run_reconcile_and_cancel_print_and_exit_as_locally(
    served: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run` sends the file's text (YAML) and gets the same result digest and exit 0 as the local run;
    `reconcile` of an outcome_unknown run finds it present (exit 0, the same text as locally), again exit 5
    as locally; `cancel` of a queued run prints `cancelled:` and its second call exits 0 unchanged; an
    unknown run exits 4 as locally."""
    definition = str(served.examples / "revenue_by_region" / "dataflow.yaml")
    local_run = dataflow(capsys, "--db", served.db_url, "run", definition, "-p", "day=2026-11-02",
                         "--tenant", "acme", "--json")  # fmt: skip
    api_run = remote_dataflow(served, capsys, monkeypatch, "run", definition, "-p", "day=2026-11-02", "--json")
    assert (api_run.code, local_run.code) == (0, 0), api_run.stderr
    local_doc, api_doc = json.loads(local_run.stdout), json.loads(api_run.stdout)
    assert set(api_doc) == set(local_doc)
    for field in ("status", "recovery_status", "row_count", "output_digest", "definition_hash", "parameters"):
        assert api_doc[field] == local_doc[field], field
    assert api_doc["principal"] == "token:acme-operator" and api_doc["provenance"]["trigger"] == "api"

    locally_unknown = make_outcome_unknown_run(served.platform, served.examples, "acme", key="a")
    remotely_unknown = make_outcome_unknown_run(served.platform, served.examples, "acme", key="b")
    local = dataflow(capsys, "--db", served.db_url, "reconcile", locally_unknown.run_id)
    over_api = remote_dataflow(served, capsys, monkeypatch, "reconcile", remotely_unknown.run_id)
    assert (over_api.code, local.code) == (0, 0), over_api.stderr
    assert over_api.stdout.splitlines()[0] == local.stdout.splitlines()[0]  # "finding: present — ..."
    again_local = dataflow(capsys, "--db", served.db_url, "reconcile", locally_unknown.run_id)
    again_api = remote_dataflow(served, capsys, monkeypatch, "reconcile", remotely_unknown.run_id)
    assert again_api.code == again_local.code == 5
    assert again_api.stderr.replace(remotely_unknown.run_id, "RUN") == again_local.stderr.replace(
        locally_unknown.run_id, "RUN"
    )

    queued = make_queued_run(served.platform, served.examples, "acme", key="to-cancel")
    cancelled = remote_dataflow(served, capsys, monkeypatch, "cancel", queued.run_id)
    assert cancelled.code == 0 and cancelled.stdout.startswith("cancelled:"), cancelled.output
    assert served.platform.runs.get(queued.run_id).status == "cancelled"
    again = remote_dataflow(served, capsys, monkeypatch, "cancel", queued.run_id, "--json")
    assert again.code == 0 and json.loads(again.stdout)["cancelled"] is False
    missing_api = remote_dataflow(served, capsys, monkeypatch, "cancel", "0" * 8 + "-0000-7000-8000-" + "0" * 12)
    missing_local = dataflow(capsys, "--db", served.db_url, "cancel", "0" * 8 + "-0000-7000-8000-" + "0" * 12)
    assert missing_api.code == missing_local.code == 4
    assert missing_api.stderr.startswith("error [not_found]:")


def test_the_platform_token_reconciles_over_the_api(
    served: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With only a platform token, `dataflow --api URL reconcile RUN` settles a tenant's outcome_unknown run."""
    unknown = make_outcome_unknown_run(served.platform, served.examples, "acme", key="night")
    said = remote_dataflow(served, capsys, monkeypatch, "reconcile", unknown.run_id, "--json",
                           token=served.platform_token)  # fmt: skip
    assert said.code == 0, said.stderr
    assert json.loads(said.stdout)["finding"] == "present"
    assert served.platform.runs.get(unknown.run_id).status == "succeeded"


def test_refusals_exit_2(
    served: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A local-only command under --api, --api with --db, no token, and a world-readable token file each
    exit 2 with a clear message; a wrong token exits 1 unauthenticated."""
    local_only = remote_dataflow(served, capsys, monkeypatch, "definitions")
    assert local_only.code == 2 and "not available over --api" in local_only.stderr
    both = remote_dataflow(served, capsys, monkeypatch, "--db", served.db_url, "runs")
    assert both.code == 2 and "cannot be combined" in both.stderr, both.output
    combined = dataflow(capsys, "--db", served.db_url, "--api", served.url, "runs")
    assert combined.code == 2 and "cannot be combined" in combined.stderr
    no_token = dataflow(capsys, "--api", served.url, "runs")
    assert no_token.code == 2 and remote.TOKEN_VARIABLE in no_token.stderr
    token_file = tmp_path / "token"
    token_file.write_text(served.operator_token + "\n")
    token_file.chmod(0o644)
    readable = dataflow(capsys, "--api", served.url, "--token-file", str(token_file), "runs")
    assert readable.code == 2 and "readable by every user" in readable.stderr
    assert served.operator_token not in readable.output
    wrong = remote_dataflow(served, capsys, monkeypatch, "runs", token="ddf_not-a-real-token")
    assert wrong.code == 1 and wrong.stderr.startswith("error [unauthenticated]:"), wrong.output


def test_the_token_is_never_in_argv_output_or_errors(served: Served, tmp_path: Path) -> None:
    """A real `dataflow --api URL --token-file F runs` process: its /proc/PID/cmdline (read while it runs,
    from the process itself) holds the file's path, not the token; neither its output nor an error does."""
    token_file = tmp_path / "token"
    token_file.write_text(served.operator_token)
    token_file.chmod(0o600)
    script = (
        "import pathlib, sys\n"
        "cmdline = pathlib.Path('/proc/self/cmdline').read_bytes()\n"
        "sys.stderr.write('CMDLINE ' + cmdline.replace(b'\\0', b' ').decode() + '\\n')\n"
        "from durable_dataflow.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in (*SCRUBBED_ENV, remote.TOKEN_VARIABLE)}
    for args in (("runs", "--json"), ("cancel", "no-such-run")):
        done = subprocess.run(
            [sys.executable, "-c", script, "--api", served.url, "--token-file", str(token_file), *args],
            env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert "CMDLINE" in done.stderr and str(token_file) in done.stderr
        assert served.operator_token not in done.stdout + done.stderr
        assert done.returncode == (0 if args[0] == "runs" else 4), done.stderr


def test_show_and_verify_are_the_same_over_the_api(
    served: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`show --json` over --api equals the local one (but the age), and so does `verify --json`; the human
    `verify` line and `show`'s ledger table and UNRESOLVED warning read the same; both exit as locally."""
    unknown = make_outcome_unknown_run(served.platform, served.examples, "acme", key="shown")
    for command in ("show", "verify"):
        local = dataflow(capsys, "--db", served.db_url, command, unknown.run_id, "--json")
        over_api = remote_dataflow(served, capsys, monkeypatch, command, unknown.run_id, "--json")
        assert over_api.code == local.code == 0, over_api.stderr
        assert without_age(json.loads(over_api.stdout)) == without_age(json.loads(local.stdout))
    local_verify = dataflow(capsys, "--db", served.db_url, "verify", unknown.run_id)
    api_verify = remote_dataflow(served, capsys, monkeypatch, "verify", unknown.run_id)
    assert api_verify.stdout == local_verify.stdout and api_verify.stdout.startswith("evidence verified:")
    local_show = dataflow(capsys, "--db", served.db_url, "show", unknown.run_id)
    api_show = remote_dataflow(served, capsys, monkeypatch, "show", unknown.run_id)
    assert api_show.code == local_show.code == 0
    ledger_lines = [line for line in local_show.stdout.splitlines() if "dispatch" in line or "WARNING" in line]
    assert ledger_lines and all(line in api_show.stdout for line in ledger_lines)
    assert f"dataflow --api {served.url} reconcile {unknown.run_id}" in api_show.stdout


def test_ops_ledger_over_the_api_is_the_tokens_scope(
    served: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ops ledger --json` with a platform token over --api holds what the local, platform-wide one holds
    (the same counts and unresolved runs); --tenant under --api exits 2 (the token decides the scope)."""
    unknown = make_outcome_unknown_run(served.platform, served.examples, "acme", key="ops")
    local = dataflow(capsys, "--db", served.db_url, "ops", "ledger", "--json")
    over_api = remote_dataflow(served, capsys, monkeypatch, "ops", "ledger", "--json", token=served.platform_token)
    assert over_api.code == local.code == 0, over_api.stderr
    local_doc, api_doc = json.loads(local.stdout), json.loads(over_api.stdout)
    assert set(api_doc) == set(local_doc)
    assert api_doc["runs_by_status"] == local_doc["runs_by_status"]
    assert [u["run_id"] for u in api_doc["unresolved"]] == [u["run_id"] for u in local_doc["unresolved"]]
    assert [u["run_id"] for u in api_doc["unresolved"]] == [unknown.run_id]
    human = remote_dataflow(served, capsys, monkeypatch, "ops", "ledger", token=served.platform_token)
    assert human.code == 0 and unknown.run_id in human.stdout
    scoped = remote_dataflow(served, capsys, monkeypatch, "ops", "ledger", "--tenant", "acme")
    assert scoped.code == 2 and "--tenant" in scoped.stderr


class _NotTheApi(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # the standard library's name
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(b"<html>a web server, not the API</html>")

    def log_message(self, format: str, *args: Any) -> None:  # the standard library's signature
        return


def test_an_api_url_naming_another_server_exits_2(
    served: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--api naming a server that answers HTML (not the API) exits 2 saying so, not an internal error;
    a closed port exits 7 (storage_unavailable: the API cannot be reached)."""
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotTheApi)
    thread = threading.Thread(target=other.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv(remote.TOKEN_VARIABLE, served.operator_token)
        said = dataflow(capsys, "--api", f"http://127.0.0.1:{other.server_address[1]}", "runs")
        assert said.code == 2 and "is --api right?" in said.stderr, said.output
    finally:
        other.shutdown()
        other.server_close()
    closed = dataflow(capsys, "--api", f"http://127.0.0.1:{other.server_address[1]}", "runs")
    assert closed.code == 7 and "cannot be reached" in closed.stderr, closed.output
    assert served.operator_token not in said.output + closed.output
