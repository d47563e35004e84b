"""Where a file or dataset lives: a local path or an object-store URI (``s3://bucket/prefix``), as one
``pyarrow.fs`` file system and a path on it.

This is the one place that turns a user's text into a file system, so every reader, writer and
dataset of hetflow sees object storage the same way:

- **Configuration the AWS way.** Credentials, region and profile come from the standard
  environment and files (``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ``~/.aws/...``), which pyarrow reads.
  The endpoint of an S3-compatible server comes from ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``
  (the AWS SDKs' standard variables): pyarrow does not read them itself (apache/arrow#49643), so
  :func:`s3_filesystem` passes them on. Options written into a URI's query
  (``s3://b/p?endpoint_override=...&region=...``) win over the environment, as in pyarrow.
- **Secrets never travel.** :func:`redact` removes a key or secret written into a URI; every
  message of this module and every :attr:`Location.uri` is redacted, so run records and logs never
  hold them.
- **Failures say what failed.** :func:`storage_error` turns pyarrow's ``OSError`` into a
  :class:`StorageError` whose one line names the bucket, the key, the action and the cause in a
  user's words (no credentials, no such bucket, access denied, endpoint down).

Local paths stay plain paths (:attr:`Location.is_local`): the dataset code keeps its descriptor-based
safe I/O for them (no symlinks followed, directories fsynced), which ``pyarrow.fs`` cannot give.
"""

from __future__ import annotations

import fnmatch
import os
import re
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:  # imported where a file system is made or listed: pyarrow.fs loads TLS, which a local run never needs
    import pyarrow.fs as pafs

from .errors import OperatorError

OBJECT_SCHEMES = ("s3",)
"""URI schemes hetflow treats as object stores (no rename, no directories, the manifest is the commit)."""

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class StorageError(OperatorError, OSError):
    """An object-store request failed; the message names bucket, key, action and cause."""

    def __init__(self, message: str, *, uri: str, cause: str) -> None:
        super().__init__(message)
        self.uri = uri
        self.cause = cause   # one of: no-credentials, no-bucket, access-denied, endpoint-down, not-found, other


def is_uri(target: str | os.PathLike[str]) -> bool:
    """Whether ``target`` is a URI (``scheme://...``) rather than a local path; ``file://`` counts as a URI."""
    return isinstance(target, str) and bool(_URI.match(target))


def is_object_store(target: str | os.PathLike[str]) -> bool:
    """Whether ``target`` is a URI of an object store (:data:`OBJECT_SCHEMES`)."""
    return is_uri(target) and str(target).split("://", 1)[0].lower() in OBJECT_SCHEMES


def redact(uri: str) -> str:
    """``uri`` without a user name/password (``s3://KEY:SECRET@bucket/p`` -> ``s3://bucket/p``) or a
    secret written into its query."""
    if not is_uri(uri):
        return uri
    parts = urlsplit(uri)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    query = "&".join(item for item in parts.query.split("&")
                     if item and item.split("=", 1)[0].lower() not in {"access_key", "secret_key", "session_token"})
    if netloc == parts.netloc and query == parts.query:
        return uri
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def carries_settings(uri: str) -> bool:
    """Whether ``uri`` carries credentials (``s3://KEY:SECRET@bucket/...``) or pyarrow's options (a query of
    ``key=value`` pairs such as ``?endpoint_override=...``), which hetflow takes from the AWS environment only."""
    return is_uri(uri) and ("@" in urlsplit(uri).netloc or _options(uri) is not None)


def s3_endpoint() -> str | None:
    """The S3 endpoint the AWS environment names (``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``), or None."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


_FILESYSTEMS: dict[tuple[str, ...], pafs.FileSystem] = {}
_FILESYSTEMS_LOCK = threading.Lock()

_ENV_KEYS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
             "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION")


def s3_filesystem() -> pafs.FileSystem:
    """The S3 file system of the current AWS environment (one per distinct environment and process).

    The endpoint of :func:`s3_endpoint` is passed to pyarrow; everything else pyarrow finds itself.
    Buckets are never created or deleted by hetflow.
    """
    import pyarrow.fs as pafs

    key = tuple(os.environ.get(name, "") for name in _ENV_KEYS)
    with _FILESYSTEMS_LOCK:
        fs = _FILESYSTEMS.get(key)
        if fs is None:
            options: dict[str, Any] = {}
            endpoint = s3_endpoint()
            if endpoint:
                options["endpoint_override"] = endpoint
            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
            if region:
                options["region"] = region
            fs = _FILESYSTEMS[key] = pafs.S3FileSystem(**options)
        return fs


@dataclass(frozen=True)
class Location:
    """A place for files: ``filesystem`` and ``path`` on it; ``uri`` is what to show a user (redacted)."""

    filesystem: pafs.FileSystem
    path: str
    uri: str
    is_local: bool

    def join(self, *names: str) -> Location:
        """The location ``names`` below this one (``/``-joined on object stores)."""
        if self.is_local:
            path = str(Path(self.path, *names))
            return Location(self.filesystem, path, path, True)
        path = "/".join([self.path.rstrip("/"), *names])
        return Location(self.filesystem, path, "/".join([self.uri.rstrip("/"), *names]), False)

    @property
    def bucket(self) -> str | None:
        """The bucket of an object-store location, else None."""
        return None if self.is_local else self.path.split("/", 1)[0]

    @property
    def key(self) -> str:
        """The key (path inside the bucket) of an object-store location, else the path."""
        return self.path if self.is_local else (self.path.split("/", 1) + [""])[1]

    def __str__(self) -> str:
        return self.uri


def resolve(target: str | os.PathLike[str] | Location) -> Location:
    """The :class:`Location` of a local path, a ``file://`` URI or an object-store URI.

    :raises ValueError: an unsupported scheme or a URI without a bucket, naming the URI.
    """
    if isinstance(target, Location):
        return target
    import pyarrow.fs as pafs

    if not is_uri(target):
        path = os.fspath(target)
        return Location(pafs.LocalFileSystem(), path, path, True)
    uri = str(target)
    scheme = uri.split("://", 1)[0].lower()
    shown = redact(uri)
    if scheme == "file":
        path = urlsplit(uri).path
        return Location(pafs.LocalFileSystem(), path, path, True)
    if scheme not in OBJECT_SCHEMES:
        raise ValueError(f"{shown}: unsupported storage scheme {scheme!r} (expected a path, file:// or s3://)")
    parts = urlsplit(uri)
    bucket = parts.netloc.rsplit("@", 1)[-1]
    if not bucket:
        raise ValueError(f"{shown}: no bucket (expected s3://BUCKET/PREFIX)")
    options = _options(uri)
    # the key is everything after the bucket, as written: '?' (a glob) and '#' are characters of keys, unless
    # what follows a '?' is pyarrow's options (endpoint_override=..., region=...)
    key = uri.split("://", 1)[1].split("/", 1)[1] if "/" in uri.split("://", 1)[1] else ""
    if options is not None:
        key = key.split("?", 1)[0]
    path = (bucket + "/" + key.strip("/")).rstrip("/")
    if options is not None or "@" in parts.netloc:
        # options or credentials written into the URI: pyarrow's own parser honours them
        try:
            fs, path = pafs.FileSystem.from_uri(uri)
        except (OSError, ValueError, TypeError) as error:
            raise ValueError(f"{shown}: {_scrub(str(error), uri)}") from None
        if "endpoint_override" not in (options or "") and s3_endpoint():
            raise ValueError(f"{shown}: options in the URI replace the AWS environment; add "
                             f"endpoint_override=... to the URI too (AWS_ENDPOINT_URL is set)")
        return Location(fs, path.rstrip("/"), shown.split("?", 1)[0], False)
    return Location(s3_filesystem(), path, f"{scheme}://{path}", False)


_URI_OPTIONS = {"access_key", "secret_key", "session_token", "region", "scheme", "endpoint_override",
                "allow_bucket_creation", "allow_bucket_deletion", "role_arn", "session_name", "external_id",
                "load_frequency", "anonymous", "request_timeout", "connect_timeout", "background_writes",
                "force_virtual_addressing", "tls_ca_file_path"}


def _options(uri: str) -> str | None:
    """The query of ``uri`` when it is pyarrow's S3 options (``key=value`` pairs of known keys), else None:
    a ``?`` in a key or a glob is not a query."""
    if "?" not in uri:
        return None
    query = uri.split("?", 1)[1]
    pairs = [item.split("=", 1)[0] for item in query.split("&") if item]
    if pairs and all("=" in item for item in query.split("&") if item) and set(pairs) <= _URI_OPTIONS:
        return query
    return None


GLOB_CHARACTERS = "*?["
"""Characters that make a path a glob, on a file system as on an object store."""


def glob_start(path: str) -> int:
    """Where the first glob character of ``path`` is, or -1 when it is no glob."""
    return min((path.index(ch) for ch in GLOB_CHARACTERS if ch in path), default=-1)


def glob_match(pattern: str, path: str) -> bool:
    """Whether ``path`` matches ``pattern`` as :func:`glob.glob` matches a local path: segment by segment
    (``*`` and ``?`` never cross a ``/``, so ``**`` is ``*``), and a segment starting with ``.`` only where
    the pattern's does."""
    parts, names = pattern.split("/"), path.split("/")
    if len(parts) != len(names):
        return False
    return all(fnmatch.fnmatchcase(name, part) and (part.startswith(".") or not name.startswith("."))
               for part, name in zip(parts, names))


def glob_files(where: Location) -> list[pafs.FileInfo]:
    """The files the glob ``where`` matches (:func:`glob_match`), sorted by path: one recursive listing below
    the glob's fixed part.  The readers (:mod:`hetflow.operators.filesplit`) and a stage's declared files on
    an object store match by this one rule.

    :raises StorageError: the listing failed (no credentials, no bucket, access denied, endpoint down).
    """
    import pyarrow.fs as pafs

    base = where.path[:glob_start(where.path)].rsplit("/", 1)[0]
    try:
        infos = where.filesystem.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    except OSError as exc:
        raise storage_error(exc, where, "list") from exc
    return sorted((i for i in infos if i.type == pafs.FileType.File and glob_match(where.path, i.path)),
                  key=lambda i: i.path)


def check_bucket(where: Location) -> None:
    """A :class:`StorageError` if the bucket of ``where`` does not exist (S3 lists a missing bucket as empty)."""
    if not is_object_store(where.uri) or where.bucket is None:
        return
    import pyarrow.fs as pafs

    try:
        found = where.filesystem.get_file_info(where.bucket).type != pafs.FileType.NotFound
    except OSError as exc:
        raise storage_error(exc, where, "list") from exc
    if not found:
        raise storage_error(OSError("NO_SUCH_BUCKET"), where, "list")


def bucket_and_key(where: Location) -> str:
    """`` (bucket 'b', key 'k')`` for an object-store location, to follow its URI in a message; else empty."""
    return "" if where.is_local or where.bucket is None or where.uri == where.path else \
        f" (bucket {where.bucket!r}, key {where.key!r})"


def object_versions(objects: Sequence[Location]) -> list[str]:
    """What identifies each object's content without reading it: ``etag:<ETag> size:<bytes>``, from one HEAD
    request per object (several at once).  A rewritten object gets another ETag; the ETag of a multipart
    upload is no checksum of the content, but it still changes when the content does.

    :raises StorageError: a request failed (the object is gone, no credentials, endpoint down, ...).
    """
    def version(where: Location) -> str:
        try:
            with where.filesystem.open_input_file(where.path) as source:   # a HEAD request; nothing is read
                size = source.size()
                etag = source.metadata().get("ETag", b"")
        except OSError as exc:
            raise storage_error(exc, where, "read") from exc
        text = etag.decode("utf-8", "replace") if isinstance(etag, bytes) else str(etag)
        return f"etag:{text.strip(chr(34))} size:{size}"

    if len(objects) < 2:
        return [version(where) for where in objects]
    with ThreadPoolExecutor(max_workers=min(16, len(objects))) as pool:
        return list(pool.map(version, objects))


_CAUSES = (
    ("no-credentials", ("NO_CREDENTIALS", "Unable to find credentials", "No credentials", "MISSING_AUTHENTICATION")),
    ("no-bucket", ("NO_SUCH_BUCKET", "bucket does not exist")),
    ("access-denied", ("ACCESS_DENIED", "AccessDenied", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH",
                       "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden")),
    ("endpoint-down", ("NETWORK_CONNECTION", "Could not connect", "Could not resolve", "Connection refused",
                       "curlCode: 7", "curlCode: 6", "curlCode: 28", "Timeout")),
)
_HTTP_403 = re.compile(r"(?<![\w./-])403(?![\w./-])")
"""An HTTP status 403 on its own, not three digits of a key or a run id (``s3pipe-20261127-214032``)."""


def _without_names(text: str, loc: "Location | None") -> str:
    """``text`` without the names in it (the object's URI, bucket and key, anything quoted): what a cause is
    read from, so that a key holding ``Timeout`` or ``403`` does not decide it."""
    if loc is not None:
        for name in sorted({loc.uri, loc.key, loc.bucket} - {"", None}, key=len, reverse=True):  # type: ignore[arg-type]
            text = text.replace(name, "")
    return re.sub(r"'[^']*'|\"[^\"]*\"|s3://\S+", "", text)


_WORDS = {
    "no-credentials": "no AWS credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)",
    "no-bucket": "the bucket does not exist (hetflow never creates buckets)",
    "access-denied": "access denied (check the credentials and the bucket's policy)",
    "endpoint-down": "the storage endpoint cannot be reached",
    "not-found": "no such object",
}


def _scrub(text: str, uri: str) -> str:
    """``text`` with any secret of ``uri`` and the request ids of AWS messages taken out."""
    parts = urlsplit(uri) if is_uri(uri) else None
    if parts is not None and "@" in parts.netloc:
        for secret in re.split(r"[:@]", parts.netloc.rsplit("@", 1)[0]):
            if secret:
                text = text.replace(secret, "***")
    return re.sub(r"\s*\(Request ID: [^)]*\)", "", text).strip()


def storage_error(error: BaseException, location: Location | str, action: str) -> StorageError:
    """A :class:`StorageError` for ``error`` raised while doing ``action`` (``"write"``, ``"read"``, ``"list"``,
    ...) at ``location``: one line naming bucket, key, action and cause, with no secret in it."""
    loc = location if isinstance(location, Location) else None
    uri = loc.uri if loc is not None else redact(str(location))
    text = _scrub(str(error), str(location) if loc is None else loc.uri)
    cause = "not-found" if isinstance(error, FileNotFoundError) else "other"
    if cause == "other":
        probe = _without_names(text, loc)
        for name, needles in _CAUSES:
            if any(needle in probe for needle in needles) or (name == "access-denied" and _HTTP_403.search(probe)):
                cause = name
                break
    where = uri
    if loc is not None and not loc.is_local:
        where = f"{uri} (bucket {loc.bucket!r}, key {loc.key!r})"
    endpoint = s3_endpoint()
    if cause == "endpoint-down" and endpoint:
        words = f"{_WORDS[cause]} ({redact(endpoint)})"
    else:
        words = _WORDS.get(cause, text)
    return StorageError(f"cannot {action} {where}: {words}", uri=uri, cause=cause)
