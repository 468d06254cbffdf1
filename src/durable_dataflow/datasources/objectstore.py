"""S3-compatible object stores: their URLs, their connection options, and who may use which prefix.

Shared by the sources (the execution wing reads `s3://` Parquet, CSV and Delta) and the sinks (the Delta
and Parquet-folder providers publish to `s3://`), so it lives below both, with the providers.

* **URLs.** ``s3://BUCKET/KEY`` with a bucket name as S3 allows it (3 to 63 of ``a-z 0-9 . -``) and a key
  of ``/``-separated segments, none empty, ``.`` or ``..``, without control characters, ``?``, ``#`` or
  ``%``, not ending with a space (delta-rs percent-decodes a table URL and strips its trailing spaces,
  pyarrow and boto3 take a key literally).
  A URL is never resolved against anything: what is written is the object's name.
* **Options** (the same for a source's ``options`` and a target's): ``endpoint`` (an ``http(s)://host[:port]``
  URL; default: AWS), ``region``, ``allow_http`` (a plain-HTTP endpoint is refused without it) and the
  credentials ``access_key_id`` / ``secret_access_key`` / ``session_token``, each a ``{"secret": NAME}``
  reference resolved in the run's secret scope when the store is opened (never recorded, never shown).
  Without credentials the local operator's process uses the AWS default chain (environment, profile);
  a tenant always names granted secrets (`confine`).
* **Tenancy** (docs/security.md): the grants file's ``object_stores`` entries name, per prefix, the
  tenants that may read (sources) or write (sinks) there and the endpoint they reach it at. A tenant's
  location must lie inside a prefix granted to it for that access, and its endpoint, region and
  ``allow_http`` are the grant's (a definition naming another endpoint is refused: no tenant picks a host
  for the platform to send requests to). The local operator (no tenant) may use any bucket its
  credentials reach.
"""

from __future__ import annotations

import contextlib
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from durable_dataflow.core.errors import InputError
from durable_dataflow.core.secrets import SecretScope

if TYPE_CHECKING:
    from pyarrow.fs import S3FileSystem

SCHEME = "s3://"
KEY_CHARS_MAX = 1024
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
CREDENTIAL_OPTIONS = ("access_key_id", "secret_access_key", "session_token")
CONNECTION_OPTIONS = ("endpoint", "region", "allow_http")
STORE_OPTIONS = frozenset((*CONNECTION_OPTIONS, *CREDENTIAL_OPTIONS))
# A request to the store that has not answered within this many seconds fails (and is retried by the
# client): a publication whose answer never comes ends Inconclusive, not hung.
REQUEST_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 10.0

Access = Literal["read", "write"]
# Target options the platform itself adds or reads (the sink root, a registered datasource's overwrite
# permission): accepted beside the store options of an s3:// target.
PLATFORM_OPTIONS = frozenset({"base_dir", "allow_overwrite"})


def is_store_url(text: str) -> bool:
    """Whether a location or path names an object store (``s3://``, any letter case of the scheme)."""
    return text[: len(SCHEME)].lower() == SCHEME


@dataclass(frozen=True, order=True)
class StoreUrl:
    """An object's or a prefix's name in a bucket: ``key`` has no leading or trailing ``/`` ('' is the bucket)."""

    bucket: str
    key: str

    @property
    def url(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}" if self.key else f"{SCHEME}{self.bucket}"

    @property
    def path(self) -> str:
        """The ``bucket/key`` form pyarrow's S3FileSystem takes."""
        return f"{self.bucket}/{self.key}" if self.key else self.bucket

    def child(self, name: str) -> StoreUrl:
        return StoreUrl(self.bucket, f"{self.key}/{name}" if self.key else name)

    def within(self, prefix: StoreUrl) -> bool:
        """Whether this name is ``prefix`` or lies under it, segment-wise (``b/ab`` is not under ``b/a``)."""
        if self.bucket != prefix.bucket:
            return False
        return not prefix.key or self.key == prefix.key or self.key.startswith(prefix.key + "/")

    def __str__(self) -> str:
        return self.url


def parse_url(text: str, what: str) -> StoreUrl:
    """The URL as a StoreUrl; InputError naming ``what`` and the rule (never the URL: it may be a tenant's
    input) when it is not a plain ``s3://bucket/key``."""
    if not is_store_url(text):
        raise InputError(f"{what}: not an s3:// URL")
    rest = text[len(SCHEME) :]
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in rest):
        raise InputError(f"{what}: the URL must not contain control characters")
    if "?" in rest or "#" in rest or "\\" in rest:
        raise InputError(f"{what}: the URL must not contain '?', '#' or '\\'")
    if "%" in rest:
        # delta-rs reads a table URL as a URL (`%2e%2e` is `..` to it, `%20` a space) while pyarrow and boto3
        # take a key literally: a `%` would let one URL name two places, one of them outside the confinement.
        raise InputError(f"{what}: the URL must not contain '%' (an object key is taken literally)")
    bucket, _, key = rest.partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise InputError(f"{what}: the bucket name must be 3 to 63 characters of a-z, 0-9, '.' and '-'")
    key = key.rstrip("/")
    if key.endswith(" "):
        # delta-rs parses a table URL by the WHATWG rules, which strip trailing spaces: it would write
        # `a/b` where pyarrow and boto3 (and so inspection) look at `a/b `.
        raise InputError(f"{what}: the object key must not end with a space")
    if len(key) > KEY_CHARS_MAX:
        raise InputError(f"{what}: the object key is longer than {KEY_CHARS_MAX} characters")
    if key and any(segment in ("", ".", "..") for segment in key.split("/")):
        raise InputError(f"{what}: the object key must not hold empty, '.' or '..' segments")
    return StoreUrl(bucket, key)


# ---- connection options -------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreOptions:
    """How to reach a store, credentials resolved. ``repr`` never shows a credential."""

    endpoint: str | None = None
    region: str | None = None
    allow_http: bool = False
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None

    def __repr__(self) -> str:
        credentials = "set" if self.access_key_id else "default chain"
        return f"StoreOptions(endpoint={self.endpoint!r}, region={self.region!r}, credentials={credentials})"

    def filesystem(self) -> S3FileSystem:
        """A pyarrow S3 filesystem on these options (pyarrow speaks S3 itself; no DuckDB extension)."""
        from pyarrow import fs

        kwargs: dict[str, Any] = {
            "region": self.region or "us-east-1",
            "connect_timeout": CONNECT_TIMEOUT_S,
            "request_timeout": REQUEST_TIMEOUT_S,
            "check_directory_existence_before_creation": False,
        }
        if self.endpoint is not None:
            parsed = urllib.parse.urlsplit(self.endpoint)
            kwargs["endpoint_override"] = parsed.netloc
            kwargs["scheme"] = parsed.scheme
        if self.access_key_id is not None:
            kwargs["access_key"] = self.access_key_id
            kwargs["secret_key"] = self.secret_access_key
            if self.session_token is not None:
                kwargs["session_token"] = self.session_token
        return fs.S3FileSystem(**kwargs)

    def delta_storage_options(self) -> dict[str, str]:
        """delta-rs `storage_options`. delta-rs 1.x commits a log entry to S3 with a conditional put
        (``If-None-Match: *``), so concurrent writers are safe without a locking provider
        (docs/providers.md); it is never told ``AWS_S3_ALLOW_UNSAFE_RENAME``."""
        options: dict[str, str] = {
            "AWS_REGION": self.region or "us-east-1",
            "timeout": f"{int(REQUEST_TIMEOUT_S)}s",
            "connect_timeout": f"{int(CONNECT_TIMEOUT_S)}s",
        }
        if self.endpoint is not None:
            options["AWS_ENDPOINT_URL"] = self.endpoint
        if self.allow_http:
            options["AWS_ALLOW_HTTP"] = "true"
        if self.access_key_id is not None:
            options["AWS_ACCESS_KEY_ID"] = self.access_key_id
            options["AWS_SECRET_ACCESS_KEY"] = self.secret_access_key or ""
            if self.session_token is not None:
                options["AWS_SESSION_TOKEN"] = self.session_token
        return options

    def client(self) -> Any:
        """A boto3 S3 client (the optional extra ``[s3]``), for what pyarrow cannot say: a conditional
        put (``If-None-Match``) and an object's ETag and version id."""
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise InputError("an s3:// location needs the boto3 package: install durable-dataflow[s3]") from None
        config = Config(
            connect_timeout=CONNECT_TIMEOUT_S,
            read_timeout=REQUEST_TIMEOUT_S,
            retries={"max_attempts": 3, "mode": "standard"},
        )
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=self.region or "us-east-1",
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
            aws_session_token=self.session_token,
            config=config,
        )


def check_endpoint(endpoint: object, allow_http: bool, what: str) -> str:
    """An endpoint is an ``http(s)://host[:port]`` URL: no user, path, query or fragment; plain HTTP only
    with ``allow_http``."""
    if not isinstance(endpoint, str) or not endpoint:
        raise InputError(f"{what}: option 'endpoint' must be an http(s)://host[:port] URL")
    try:
        parsed = urllib.parse.urlsplit(endpoint)
        _ = parsed.port
    except ValueError:
        raise InputError(f"{what}: option 'endpoint' must be an http(s)://host[:port] URL") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.username or parsed.password:
        raise InputError(f"{what}: option 'endpoint' must be an http(s)://host[:port] URL")
    if parsed.path.strip("/") or parsed.query or parsed.fragment:
        raise InputError(f"{what}: option 'endpoint' must not hold a path, query or fragment")
    if parsed.scheme == "http" and not allow_http:
        raise InputError(f"{what}: option 'endpoint' is plain http: set allow_http: true to use it")
    return f"{parsed.scheme}://{parsed.netloc}"


def check_options(options: Mapping[str, Any], what: str, extra: frozenset[str] = frozenset()) -> None:
    """The store options' shapes, without resolving a secret: for a definition before it is recorded."""
    unknown = sorted(set(options) - STORE_OPTIONS - extra)
    if unknown:
        raise InputError(f"{what}: unknown object-store option(s) {unknown}; allowed: {sorted(STORE_OPTIONS)}")
    allow_http = options.get("allow_http", False)
    if not isinstance(allow_http, bool):
        raise InputError(f"{what}: option 'allow_http' must be true or false")
    if "endpoint" in options:
        check_endpoint(options["endpoint"], allow_http, what)
    region = options.get("region")
    if region is not None and (not isinstance(region, str) or not re.fullmatch(r"[a-z0-9-]{1,64}", region)):
        raise InputError(f"{what}: option 'region' must be a region name such as us-east-1")
    for name in CREDENTIAL_OPTIONS:
        if name in options and not _is_secret_reference(options[name]):
            raise InputError(f"{what}: option {name!r} must be a secret reference {{'secret': NAME}}")
    if ("access_key_id" in options) != ("secret_access_key" in options):
        raise InputError(f"{what}: give both access_key_id and secret_access_key, or neither")
    if "session_token" in options and "access_key_id" not in options:
        raise InputError(f"{what}: option 'session_token' needs access_key_id and secret_access_key")


def _is_secret_reference(value: object) -> bool:
    return isinstance(value, Mapping) and set(value) == {"secret"} and isinstance(value["secret"], str)


def secret_references(options: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(option, secret name) of each credential option."""
    named = [name for name in CREDENTIAL_OPTIONS if _is_secret_reference(options.get(name))]
    return [(name, str(options[name]["secret"])) for name in named]


def store_options(
    options: Mapping[str, Any], scope: SecretScope, what: str, extra: frozenset[str] = PLATFORM_OPTIONS
) -> StoreOptions:
    """The options resolved: credentials through the run's secret scope (InputError naming the option,
    never a value, when one does not resolve). An option that is neither a store option nor in ``extra``
    is refused (a misspelt ``endpoint`` would otherwise send the requests to AWS)."""
    check_options(options, what, extra)
    relevant = {k: v for k, v in options.items() if k in STORE_OPTIONS}
    allow_http = bool(relevant.get("allow_http", False))
    endpoint = check_endpoint(relevant["endpoint"], allow_http, what) if "endpoint" in relevant else None
    resolved: dict[str, str | None] = {}
    for name in CREDENTIAL_OPTIONS:
        if name in relevant:
            try:
                resolved[name] = scope.resolve(str(relevant[name]["secret"])).reveal()
            except InputError as error:
                raise InputError(f"{what}: option {name!r}: {error.message}") from None
    return StoreOptions(
        endpoint=endpoint,
        region=relevant.get("region"),
        allow_http=allow_http,
        access_key_id=resolved.get("access_key_id"),
        secret_access_key=resolved.get("secret_access_key"),
        session_token=resolved.get("session_token"),
    )


# ---- tenancy ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreGrant:
    """A prefix of a store granted to a run (from the grants file's ``object_stores``): what it may do
    there and where the store is."""

    prefix: StoreUrl
    access: frozenset[str]
    endpoint: str | None = None
    region: str | None = None
    allow_http: bool = False

    def as_json(self) -> dict[str, Any]:
        return {
            "prefix": self.prefix.url,
            "access": sorted(self.access),
            "endpoint": self.endpoint,
            "region": self.region,
            "allow_http": self.allow_http,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StoreGrant:
        return cls(
            prefix=parse_url(str(data["prefix"]), "object store grant"),
            access=frozenset(str(a) for a in data.get("access") or ()),
            endpoint=data.get("endpoint"),
            region=data.get("region"),
            allow_http=bool(data.get("allow_http", False)),
        )


def confine(
    url: StoreUrl, options: Mapping[str, Any], grants: tuple[StoreGrant, ...] | None, access: Access, what: str
) -> dict[str, Any]:
    """The options a run uses to reach ``url``. ``grants`` None: the local operator, who may use any
    bucket (its options as given). Otherwise the URL must lie inside a prefix granted for ``access``,
    the definition must name its credentials as secrets (the server's own AWS credentials are never
    lent to a tenant), and the grant's endpoint, region and allow_http replace the definition's; a
    definition naming another endpoint or region is refused. The refusal names the rule, not the URL."""
    if grants is None:
        return dict(options)
    grant = next((g for g in grants if access in g.access and url.within(g.prefix)), None)
    if grant is None:
        raise InputError(
            f"{what}: the s3:// location is outside the object-store prefixes granted to this tenant for "
            f"{'reading' if access == 'read' else 'writing'} (the grants file's object_stores)"
        )
    if "access_key_id" not in options:
        raise InputError(
            f"{what}: a tenant's s3:// location needs credentials: name granted secrets in the options "
            "access_key_id and secret_access_key"
        )
    given = options.get("endpoint")
    if given is not None and check_endpoint(given, True, what) != grant.endpoint:
        raise InputError(f"{what}: option 'endpoint' differs from the endpoint granted for this prefix")
    if options.get("region") is not None and options.get("region") != grant.region:
        raise InputError(f"{what}: option 'region' differs from the region granted for this prefix")
    confined = {k: v for k, v in options.items() if k not in CONNECTION_OPTIONS}
    if grant.endpoint is not None:
        confined["endpoint"] = grant.endpoint
    if grant.region is not None:
        confined["region"] = grant.region
    confined["allow_http"] = grant.allow_http
    return confined


NO_CREATE_ONCE = (
    "the store does not honour conditional writes (If-None-Match: *): concurrent writers there could "
    "overwrite each other's commits"
)


def require_create_once(store: StoreOptions, prefix: StoreUrl) -> None:
    """Refuse a store that ignores ``If-None-Match: *``: a probe object under ``prefix`` is put twice with
    it, and the second put must be refused (412). Removed after. InputError (NO_CREATE_ONCE) when the
    store takes both; a missing bucket or an unreachable store raises the client's error."""
    import uuid

    client = store.client()
    name = prefix.child(f"_dataflow_probe/{uuid.uuid4().hex}")
    try:
        client.put_object(Bucket=name.bucket, Key=name.key, Body=b"probe", IfNoneMatch="*")
        try:
            client.put_object(Bucket=name.bucket, Key=name.key, Body=b"probe", IfNoneMatch="*")
        except Exception as exc:
            response = getattr(exc, "response", None) or {}
            if (response.get("ResponseMetadata") or {}).get("HTTPStatusCode") in (409, 412):
                return
            raise
        raise InputError(NO_CREATE_ONCE)
    finally:
        with contextlib.suppress(Exception):  # a leftover probe object names nothing
            client.delete_object(Bucket=name.bucket, Key=name.key)


def describe_error(exc: BaseException) -> str:
    """A store error for a message: its type and, for an S3 error answer, its code; never its text
    (which may quote a URL, a key or a signature)."""
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):
        code = (response.get("Error") or {}).get("Code")
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        return f"{type(exc).__name__} {code or ''} {status or ''}".strip()
    return type(exc).__name__
