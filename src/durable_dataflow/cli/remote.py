"""The remote CLI (issue 33 item 5): ``dataflow --api URL`` talks to the HTTP API with a token instead of
opening the platform database, so an operator needs no database URL (which is more privileged).

The token comes from ``DATAFLOW_TOKEN`` or ``--token-file PATH``, never from a command-line argument: argv
is readable by every user of the machine (``ps``, /proc/PID/cmdline). A token file readable by every user
is refused for the same reason. Answers are the API's run JSON, turned back into the read views the local
commands print (``run_view``), and its errors are the platform's own codes (``{"error": {"code",
"message"}}``, api/errors.py) raised as DataflowError, so ``common.report_error`` prints them and exits
with the same status as the local command. Only the standard library speaks HTTP here: the CLI installs
without the server extra.

A command that runs over --api reads what the API answers (the same JSON its local ``--json`` prints) and
prints it with the local command's own renderer. Options that have no meaning over the API (``--tenant``:
the token's tenant is used; ``--now``: the server's database clock is the present) are refused when given
(``refuse_options``), never silently ignored.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from durable_dataflow.core.errors import DataflowError, InputError, StorageUnavailable

if TYPE_CHECKING:
    from http.client import HTTPResponse

    from rich.text import Text

    from durable_dataflow.dataflow.protocol.views import RunView

API_URL_VARIABLE = "DATAFLOW_API_URL"
TOKEN_VARIABLE = "DATAFLOW_TOKEN"
REQUEST_TIMEOUT_S = 300.0  # an inline `run` answers when the run ends
ANSWER_BYTES_MAX = 64 * 1024 * 1024
TOKEN_FILE_BYTES_MAX = 4096
# The commands that talk to the API under --api; any other exits 2 naming itself.
REMOTE_COMMANDS = (
    "run", "submit", "runs", "show", "verify", "result", "reconcile", "cancel", "schedules", "backfill", "partitions",
    "ops", "workers",
)  # fmt: skip
YAML_MEDIA_TYPE = "application/yaml"
JSON_MEDIA_TYPE = "application/json"
ARROW_STREAM_MEDIA_TYPE = "application/vnd.apache.arrow.stream"  # GET /v1/runs/{id}/result


@dataclass(frozen=True)
class Remote:
    """The API at ``url``, called with ``token`` (never shown: repr leaves it out)."""

    url: str
    token: str = field(repr=False)

    def call(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str | list[str]] | None = None,
        body: bytes | None = None,
        media_type: str = JSON_MEDIA_TYPE,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        """The answer's JSON; an error answer raised as the DataflowError its code names."""
        with self._opened(method, path, query, body, media_type, headers, JSON_MEDIA_TYPE) as answer:
            try:
                document = json.loads(answer.read(ANSWER_BYTES_MAX))
            except ValueError:  # an answer that is not JSON: --api names some other server
                raise self._not_the_api() from None
        if not isinstance(document, dict):  # every answer of the API is one JSON object
            raise self._not_the_api()
        return document

    @contextlib.contextmanager
    def stream(self, method: str, path: str, media_type: str) -> Iterator[io.RawIOBase]:
        """A successful answer of ``media_type`` (not JSON: ``GET /v1/runs/{id}/result``'s Arrow stream), to
        be read inside the block, to its Content-Length or StorageUnavailable (``_Whole``). An error answer
        is raised as the DataflowError its code names; one of another media type as "is --api right?"."""
        with self._opened(method, path, None, None, JSON_MEDIA_TYPE, None, media_type) as answer:
            if answer.headers.get_content_type() != media_type:
                raise self._not_the_api()
            yield _Whole(answer, self.url)

    @contextlib.contextmanager
    def _opened(
        self,
        method: str,
        path: str,
        query: Mapping[str, str | list[str]] | None,
        body: bytes | None,
        media_type: str,
        headers: Mapping[str, str] | None,
        accept: str,
    ) -> Iterator[HTTPResponse]:
        import urllib.error  # here, not at the top: http.client and email cost `dataflow --help` ≈ 17 ms
        import urllib.request

        url = self.url.rstrip("/") + path
        if query:
            url += "?" + urllib.parse.urlencode(query, doseq=True)
        request = urllib.request.Request(url, data=body, method=method)
        request.add_header("Authorization", f"Bearer {self.token}")
        request.add_header("Accept", accept)
        if body is not None:
            request.add_header("Content-Type", media_type)
        for name, value in (headers or {}).items():
            request.add_header(name, value)
        # No redirect is followed: urllib's handler would carry the Authorization header to whatever host
        # (or scheme) a 30x names. The API never redirects, so one is an answer from something else.
        opener = urllib.request.build_opener(_no_redirect_handler())
        try:
            with opener.open(request, timeout=REQUEST_TIMEOUT_S) as answer:  # http(s) only
                yield answer
        except urllib.error.HTTPError as error:
            if 300 <= error.code < 400:
                raise InputError(
                    f"{self.url} answered with a redirect (HTTP {error.code}), which is not followed: the token is "
                    "sent only to the URL given; give the API's own URL to --api"
                ) from None
            raise _error_of(error.code, error.read(ANSWER_BYTES_MAX)) from None
        except TimeoutError:
            raise StorageUnavailable(
                f"the API at {self.url} did not answer within {REQUEST_TIMEOUT_S:.0f} s; a run it executes goes on: "
                "see `dataflow --api URL runs`"
            ) from None
        except (urllib.error.URLError, ConnectionError) as error:
            reason = getattr(error, "reason", error)
            raise StorageUnavailable(f"the API at {self.url} cannot be reached: {type(reason).__name__}") from None

    def _not_the_api(self) -> InputError:
        return InputError(f"{self.url} answered with something other than the API's JSON: is --api right?")


def _no_redirect_handler() -> Any:
    import urllib.request

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None  # urllib then raises HTTPError with the 30x code

    return NoRedirect


class _Whole(io.RawIOBase):
    """A streamed answer read to its very end: each read fills what it is asked for unless the answer ends
    (a reader such as pyarrow's takes a short read for the end of the stream). http.client ends a read
    quietly when the server closes the connection before Content-Length (the server lost its database half
    way); this raises StorageUnavailable instead, so a truncated stream is never taken for a whole one."""

    def __init__(self, answer: HTTPResponse, url: str) -> None:
        super().__init__()
        self._answer = answer
        self._url = url

    def readable(self) -> bool:
        return True

    def readinto(self, into: Any) -> int:
        view = memoryview(into).cast("B")
        filled = 0
        while filled < len(view):
            read = self._answer.readinto(view[filled:])
            if not read:
                missing = self._answer.length  # what Content-Length still promised (None: not declared)
                if missing:
                    raise StorageUnavailable(
                        f"the API at {self._url} stopped sending its answer {missing} bytes before its end"
                    )
                break
            filled += read
        return filled


def _error_of(status: int, raw: bytes) -> DataflowError:
    """The API's error answer as a DataflowError with the same code (its exit status is the local one's)."""
    try:
        found = json.loads(raw)["error"]
        code, message = str(found["code"]), str(found["message"])
    except (ValueError, KeyError, TypeError):
        code, message = "internal", f"the API answered HTTP {status} without an error body"
    error = DataflowError(message)
    error.code = code  # the instance carries the API's code: the CLI's one table maps it to an exit status
    return error


def read_token(token_file: Path | None, environ: Mapping[str, str] = os.environ) -> str:
    """The token from ``token_file`` (not readable by every user), else ``DATAFLOW_TOKEN``."""
    if token_file is not None:
        try:
            mode = token_file.stat().st_mode
            if mode & stat.S_IROTH:
                raise InputError(
                    f"--token-file {token_file} is readable by every user of this machine; "
                    f"restrict it first: chmod 600 {token_file}"
                )
            with token_file.open("rb") as handle:
                raw = handle.read(TOKEN_FILE_BYTES_MAX + 1)
        except OSError as error:
            raise InputError(f"--token-file {token_file} cannot be read: {error.strerror}") from None
        if len(raw) > TOKEN_FILE_BYTES_MAX:
            raise InputError(f"--token-file {token_file} is larger than {TOKEN_FILE_BYTES_MAX} bytes: not a token")
        token = raw.decode("utf-8", errors="replace").strip()
        origin = f"--token-file {token_file}"
    else:
        token = environ.get(TOKEN_VARIABLE, "").strip()
        origin = f"${TOKEN_VARIABLE}"
    if not token:
        raise InputError(f"--api needs a token: set ${TOKEN_VARIABLE}, or give --token-file PATH ({origin} is empty)")
    if any(ch.isspace() or not ch.isprintable() for ch in token):
        raise InputError(f"{origin} holds more than one token-like word: give only the token")
    return token


def api_url_of(given: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """``--api URL``, else ``DATAFLOW_API_URL``, else None (the local CLI); only http(s) URLs."""
    url = given if given is not None else environ.get(API_URL_VARIABLE, "").strip() or None
    if url is None:
        return None
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc or parsed.username or parsed.password:
        raise InputError("--api must be an http:// or https:// URL without a user or password")
    if parsed.query or parsed.fragment or "?" in url or "#" in url:  # never echo it: it may hold a secret
        raise InputError("--api must be the API's base URL, without a query (?…) or fragment (#…)")
    return url


def run_view(data: Mapping[str, Any]) -> RunView:
    """The API's run JSON (``ShownRun.as_json``) as the read view the local commands print."""
    from pydantic import ValidationError

    from durable_dataflow.dataflow.protocol.runs import Run
    from durable_dataflow.dataflow.protocol.views import RunView

    derived = ("unresolved", "lease_expired", "age_s")
    try:
        run = Run.model_validate({**{k: v for k, v in data.items() if k not in derived}, "base_dir": ""})
        return RunView(run, lease_expired=bool(data["lease_expired"]), unresolved=bool(data["unresolved"]),
                       warning=data.get("warning"))  # fmt: skip
    except (KeyError, TypeError, AttributeError, ValidationError):
        raise not_the_api() from None


def not_the_api() -> InputError:
    """An answer whose JSON is not shaped as the API's: --api names some other server."""
    return InputError("the server at --api answered JSON that is not the API's: is --api right?")


def run_body(definition_text: str, parameters: Mapping[str, str], max_attempts: int) -> bytes:
    """The POST /v1/runs document as YAML: the definition file's text indented under ``definition:`` (the
    server parses it with the strict loader), then the parameters and attempts."""
    return _yaml_body(definition_text, {"parameters": dict(parameters), "max_attempts": max_attempts})


def _yaml_body(definition_text: str, rest: Mapping[str, Any]) -> bytes:
    import yaml

    indented = "".join(f"  {line}\n" for line in definition_text.splitlines())
    tail = yaml.safe_dump(dict(rest), sort_keys=False) if rest else ""
    return f"definition:\n{indented}{tail}".encode()


@dataclass(frozen=True)
class Body:
    """A request body and its media type."""

    data: bytes
    media_type: str


def definition_body(file: Path, **rest: Any) -> Body:
    """A body holding the definition file as ``definition`` and ``rest`` beside it, once the file parses and
    validates here as the local command's does (the same refusals, naming the file; nothing is sent
    otherwise). A YAML file's text is sent as YAML, parsed by the server with the same strict loader; a
    ``.json`` file (which the local command reads as JSON) as a JSON document."""
    from durable_dataflow.core import strictjson
    from durable_dataflow.core.files import read_capped
    from durable_dataflow.dataflow.definitions.definitions import DEFINITION_BYTES_MAX, parse_definition

    try:
        text = read_capped(file, DEFINITION_BYTES_MAX, f"{file}: the definition").decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{file}: the definition is not UTF-8 text") from None
    parse_definition(text, str(file))
    if str(file).lower().endswith(".json"):  # as parse_definition reads it: JSON, not YAML
        document = {"definition": strictjson.loads(text), **rest}
        return Body(json.dumps(document).encode(), JSON_MEDIA_TYPE)
    return Body(_yaml_body(text, rest), YAML_MEDIA_TYPE)


def quoted(segment: str) -> str:
    """One path segment of a URL (a run id, a schedule or datasource name), every reserved character escaped."""
    return urllib.parse.quote(segment, safe="")


def refuse_options(ctx: Any, reason: str, *names: str) -> None:
    """Under --api: an InputError naming each option of ``names`` (parameter names) given on the command
    line, which has no meaning over the API (``reason`` says why). ``ctx`` is the command's Typer context."""
    given: list[str] = []
    for name in names:
        source = ctx.get_parameter_source(name)
        if source is not None and source.name != "DEFAULT":
            given.extend(p.opts[0] for p in ctx.command.params if p.name == name)
    if given:
        raise InputError(f"{' and '.join(given)} {'does' if len(given) == 1 else 'do'} not apply under --api: {reason}")


def status_cell(status: str, unresolved: bool) -> Text:
    """A run's status cell from its JSON (status, unresolved) exactly as ``common.status_text`` draws it from
    the run: UNRESOLVED in bold yellow, never 'failed'."""
    from rich.text import Text

    if unresolved:
        return Text("UNRESOLVED", style="bold yellow")
    style = {"succeeded": "green", "failed": "red", "cancelled": "magenta"}.get(status, "cyan")
    return Text(status, style=style)


def run_views(api: Remote, run_ids: Sequence[str]) -> list[RunView]:
    """The runs as the server reads them now (``GET /v1/runs/{id}`` each), in order: what a warning block
    needs beyond a listing's JSON (the keys, digest and next step of an unresolved run)."""
    return [run_view(api.call("GET", f"/v1/runs/{quoted(run_id)}")["run"]) for run_id in run_ids]
