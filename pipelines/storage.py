"""Object storage for everything that reads: URLs (gs://, s3://, any fsspec protocol) next to paths.

One home for URLs. A local path never goes through fsspec; a URL does, and fsspec with the
protocol's client (gcsfs, s3fs: the ``cloud`` extra) is imported only when a URL is used::

    is_url("gs://bucket/data/a.parquet")            # True; "data/a.parquet" -> False
    expand("gs://bucket/data/*.parquet")            # sorted URLs of the matching objects
    exists(url), size(url), read_json(url)          # small objects, metadata
    with local_copy(url) as path: ...               # one-shot: a temp file, removed after
    scratch_dir("stage"), sweep_scratch()           # temp directories a killed run leaves
    cached_copy(url, cache_dir=...)                 # the training reader's kept copy
    version(url), read_ranges(url, starts, ends)     # an index's reads of parts of objects

Copies are streamed in blocks (`BLOCK` bytes; memory does not grow with the object) to a
temporary name in the target directory and renamed when complete, so a copy that exists is
whole.

The cache (`cached_copy`): ``{cache_dir}/{sha256(url, size, version)[:32]}/{object name}``,
where version is the object's generation (GCS), ETag (S3) or md5, whichever the store reports.
A hit costs one metadata request to the store (no bytes); a changed object gets a new key and is
downloaded again (the old copy stays until the cache directory is cleaned). With `expect`
(size, sha256), as for packed shards whose manifest records both, the key is the sha256 itself,
the download is checked before it is renamed into place, and a hit costs one `stat` and no
request at all. The default cache directory is ``$SEQPACK_CACHE_DIR``, else
``$XDG_CACHE_HOME/seqpack``, else ``~/.cache/seqpack``.

Credentials are the clients' standard ones: Application Default Credentials for GCS (gcsfs);
the AWS environment, profile or instance role for S3 (s3fs). Emulators come in through the
standard variables: ``STORAGE_EMULATOR_HOST`` (GCS; then requests are anonymous, and
``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` defaults to ``false``: recent gcsfs otherwise probes each
bucket over gRPC first, about 60 s against an emulator) and ``AWS_ENDPOINT_URL`` (S3).

Errors: a missing client -> `MissingDependency` naming ``seqpack[cloud]``; a missing object ->
`InputError` naming the URL.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

from seqpack.pipelines.errors import InputError, MissingDependency, require

__all__ = ["Replaced", "cache_root", "cached_copy", "exists", "expand", "glob", "is_url", "join",
           "local_copy", "named", "process_gone", "process_start_time", "read_bytes", "read_json",
           "read_ranges", "scratch", "scratch_dir", "size", "sizes", "sweep_scratch", "version"]

BLOCK = 8 << 20  # bytes per read while copying an object
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_GLOB = re.compile(r"[*?[]")
_CLIENTS = {"gs": "gcsfs", "gcs": "gcsfs", "s3": "s3fs", "s3a": "s3fs"}
# What identifies one version of an object, in the order the stores report it.
_VERSION_KEYS = ("generation", "VersionId", "ETag", "etag", "md5Hash", "LastModified", "mtime")


class Replaced(InputError):
    """An object whose bytes are not the ones its caller knows it by (`cached_copy(expect=)`)."""


def is_url(path: Any) -> bool:
    """True for ``scheme://...`` (gs://, s3://, ...); False for a local path."""
    return isinstance(path, str) and _SCHEME.match(path) is not None


def _scheme(url: str) -> str:
    match = _SCHEME.match(url)
    assert match, url
    return match.group(1).lower()


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, the path inside it) of a URL; imports fsspec and the client here."""
    scheme = _scheme(url)
    fsspec = require("fsspec", f"{url}")
    options: dict[str, Any] = {}
    client = _CLIENTS.get(scheme)
    if client == "gcsfs" and os.environ.get("STORAGE_EMULATOR_HOST"):
        # Read by gcsfs when it is imported: without it, a ~60 s gRPC probe per bucket.
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        options["token"] = "anon"  # the emulator checks no credentials; don't look for any
    if client:
        require(client, f"{url}")
        # Every call asks the store: another process may have replaced an object since this
        # process listed its prefix (fsspec instances, and their listings, live as long as it).
        options["use_listings_cache"] = False
    try:
        fs = fsspec.filesystem(scheme, **options)
    except ValueError as e:  # an unknown protocol
        raise InputError(f"{url}: {e}") from None
    except ImportError as e:  # a protocol whose client is not installed (az://: adlfs, ...)
        raise MissingDependency(f"{url} needs the fsspec client of {scheme}:// ({e})") from None
    return fs, fs._strip_protocol(url)


def _missing(url: str, what: str = "object") -> InputError:
    return InputError(f"{url}: no such {what}")


def expand(paths: str | Sequence[str]) -> list[str]:
    """Paths with their URL globs expanded: each URL holding ``*``, ``?`` or ``[`` becomes the
    sorted URLs of the objects it matches (InputError if none); local paths (globs included:
    the shell expands those) and plain URLs are kept as they are, in order."""
    if isinstance(paths, str):
        paths = [paths]
    out: list[str] = []
    for path in paths:
        path = os.fspath(path)
        if not (is_url(path) and _GLOB.search(path.split("://", 1)[1])):
            out.append(path)
            continue
        found = glob(path)
        if not found:
            raise InputError(f"{path}: no objects match")
        out.extend(found)
    return out


def glob(pattern: str) -> list[str]:
    """The sorted URLs of the objects a URL pattern matches (none: an empty list)."""
    fs, inside = filesystem(pattern)
    scheme = _scheme(pattern)
    found = fs.glob(inside, detail=True)
    return sorted(f"{scheme}://{p}" for p, info in found.items() if info.get("type") != "directory")


def _info(url: str) -> dict[str, Any]:
    fs, path = filesystem(url)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise _missing(url) from None
    if info.get("type") == "directory":
        raise InputError(f"{url}: a prefix (directory), not an object")
    return info


def exists(path: str) -> bool:
    """Whether a file (local path) or an object (URL) exists."""
    if not is_url(path):
        return os.path.isfile(path)
    fs, p = filesystem(path)
    return bool(fs.isfile(p))


def size(path: str) -> int:
    """Bytes of a file or an object; InputError naming it if it is missing."""
    if not is_url(path):
        if not os.path.isfile(path):
            raise InputError(f"{path}: no such file")
        return os.path.getsize(path)
    return int(_info(path)["size"])


def sizes(prefix: str) -> dict[str, int]:
    """name -> bytes of the objects directly under a URL prefix (one listing request, paged by
    the store), or of the files in a local directory."""
    if not is_url(prefix):
        return {n: os.path.getsize(os.path.join(prefix, n)) for n in os.listdir(prefix)
                if os.path.isfile(os.path.join(prefix, n))}
    fs, path = filesystem(prefix)
    try:
        listing = fs.ls(path.rstrip("/"), detail=True, refresh=True)
    except FileNotFoundError:
        return {}
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e["size"]) for e in listing
            if e.get("type") != "directory"}


def version(url: str) -> str:
    """What identifies the object's current version (generation, ETag, ...: the first of
    `_VERSION_KEYS` the store reports; "" if none); InputError naming it if it is missing."""
    return _tag(_info(url))


def _tag(info: dict[str, Any]) -> str:
    return next((str(info[k]) for k in _VERSION_KEYS if info.get(k)), "")


def read_ranges(urls: str | Sequence[str], starts: Sequence[int], ends: Sequence[int]
                ) -> list[bytes]:
    """The bytes [start, end) of each range of `urls` (one URL for all, or one a range),
    fetched together (concurrently where the client is asynchronous: gcsfs, s3fs); InputError
    naming an object that is missing or shorter."""
    urls = [urls] * len(starts) if isinstance(urls, str) else list(urls)
    starts, ends = [int(a) for a in starts], [int(b) for b in ends]
    groups: dict[int, tuple[Any, list[int], list[str]]] = {}
    for k, url in enumerate(urls):  # one call per filesystem (in practice: one)
        fs, path = filesystem(url)
        groups.setdefault(id(fs), (fs, [], []))[1].append(k)
        groups[id(fs)][2].append(path)
    got: list[Any] = [b""] * len(urls)
    for fs, ks, paths in groups.values():
        try:
            blobs = fs.cat_ranges(paths, [starts[k] for k in ks], [ends[k] for k in ks])
        except FileNotFoundError:
            raise _missing(urls[ks[0]]) from None
        for k, blob in zip(ks, blobs):
            got[k] = blob
    for url, blob, a, b in zip(urls, got, starts, ends):
        if isinstance(blob, FileNotFoundError):
            raise _missing(url)
        if isinstance(blob, BaseException):
            raise InputError(f"{url}: bytes [{a}, {b}) could not be read ({blob})")
        if len(blob) != b - a:
            raise InputError(f"{url}: bytes [{a}, {b}) read as {len(blob)} bytes; the object "
                             "is shorter than its manifest entry")
    return got


def join(base: str, name: str) -> str:
    """`name` inside the directory or prefix `base`."""
    return base.rstrip("/") + "/" + name if is_url(base) else os.path.join(base, name)


def read_bytes(path: str) -> bytes:
    """A whole (small) file or object."""
    if not is_url(path):
        with open(path, "rb") as f:
            return f.read()
    fs, p = filesystem(path)
    try:
        return fs.cat_file(p)
    except FileNotFoundError:
        raise _missing(path) from None


def read_json(path: str) -> Any:
    """A small JSON file or object, parsed; InputError naming it if it is not JSON."""
    try:
        return json.loads(read_bytes(path))
    except ValueError as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None


def _download(url: str, target: str, expect: tuple[int, str] | None = None) -> None:
    """Streams the object to `target` (through a temporary name beside it, renamed when whole);
    with `expect` = (size, sha256), refuses a copy that differs."""
    fs, path = filesystem(url)
    directory = os.path.dirname(os.path.abspath(target))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".part-", suffix=".tmp")
    try:
        digest, n = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as dst:
            try:
                with fs.open(path, "rb", block_size=BLOCK) as src:
                    while block := src.read(BLOCK):
                        dst.write(block)
                        digest.update(block)
                        n += len(block)
            except FileNotFoundError:
                raise _missing(url) from None
        if expect is not None and (n, digest.hexdigest()) != (expect[0], expect[1]):
            raise Replaced(f"{url}: {n} bytes with sha256 {digest.hexdigest()[:12]}..., the "
                             f"manifest says {expect[0]} bytes, {expect[1][:12]}...; the object "
                             "is damaged or replaced")
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


_SCRATCH = re.compile(r"seqpack-[a-z]+-(\d+)\.(\d+|x)-[a-z0-9_]+")


def process_start_time(pid: int | None = None) -> str | None:
    """A process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def process_gone(pid: int, started: str | None) -> bool:
    """Whether process `pid` of this host (started at `started`, if known) has ended."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's: alive
        return False
    return started is not None and process_start_time(pid) not in (None, started)


def scratch_dir(kind: str, *, dir: str | None = None) -> str:
    """A new temporary directory named by this process (``seqpack-<kind>-<pid>.<start>-...``),
    so that `sweep_scratch` can remove it once the process is gone, however it died."""
    return tempfile.mkdtemp(prefix=f"seqpack-{kind}-{os.getpid()}.{process_start_time() or 'x'}-",
                            dir=dir)


@contextlib.contextmanager
def scratch(kind: str) -> Iterator[str]:
    """A `scratch_dir`, removed on exit; first removes those of processes that are gone."""
    sweep_scratch()
    path = scratch_dir(kind)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def scratch_tempdir(kind: str) -> Iterator[str]:
    """Runs the body with this process's temporary files (`tempfile`, and TMPDIR for the
    processes it starts) in a `scratch_dir`, removed after: for a framework that leaves its
    own behind (Beam's job service and workers leave empty directories each run)."""
    path = scratch_dir(kind)
    saved = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = os.environ["TMPDIR"] = path
    try:
        yield path
    finally:
        tempfile.tempdir = saved[0]
        if saved[1] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved[1]
        shutil.rmtree(path, ignore_errors=True)


def sweep_scratch() -> int:
    """Removes the system temp directory's `scratch_dir`s whose process has ended (a run killed
    with SIGKILL, or by the OOM killer, leaves its staged shards, spill and downloads there);
    returns how many."""
    removed = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(tempfile.gettempdir()):
            m = _SCRATCH.fullmatch(entry.name)
            if m and entry.is_dir(follow_symlinks=False) and int(m[1]) != os.getpid() \
                    and process_gone(int(m[1]), None if m[2] == "x" else m[2]):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed += 1
    return removed


@contextlib.contextmanager
def local_copy(path: str, *, dir: str | None = None) -> Iterator[str]:
    """A local file holding `path`'s bytes, for one read: a local path is yielded as it is; a
    URL is downloaded to a temporary file (in `dir`, default the system's temp directory),
    removed on exit. InputError naming the URL if the object is missing."""
    if not is_url(path):
        yield path
        return
    tmpdir = scratch_dir("copy", dir=dir)
    try:
        target = os.path.join(tmpdir, _object_name(path))
        _download(path, target)
        yield target
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


@contextlib.contextmanager
def local_copies(paths: Sequence[str]) -> Iterator[list[str]]:
    """`local_copy` of several objects at once, side by side in one temporary directory under
    their own names (files that are read as a set: a Megatron .bin with its .idx)."""
    if not any(is_url(p) for p in paths):
        yield list(paths)
        return
    tmpdir = scratch_dir("copy")
    try:
        targets = []
        for p in paths:
            targets.append(os.path.join(tmpdir, _object_name(p)))
            _download(p, targets[-1])
        yield targets
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


@contextlib.contextmanager
def named(local: str, path: str) -> Iterator[None]:
    """An InputError raised inside names `path` (a URL) instead of its local copy `local`."""
    if local == path:
        yield
        return
    try:
        yield
    except InputError as e:
        raise InputError(str(e).replace(local, path)) from None


def _object_name(url: str) -> str:
    """The object's last name (its extension picks the input format), safe as a file name."""
    name = url.rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "object"


def cache_root() -> str:
    """The default cache directory (see the module docstring)."""
    explicit = os.environ.get("SEQPACK_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "seqpack")


def cached_copy(path: str, *, cache_dir: str | os.PathLike | None = None,
                expect: tuple[int, str] | None = None) -> str:
    """A local file holding `path`'s bytes, kept in the cache directory and reused while the
    object is unchanged (see the module docstring for the key and the cost of a hit). A local
    path is returned as it is. `expect` = (size, sha256): the bytes the caller knows the object
    must have (a packed shard's manifest entry); a download that differs is refused with an
    InputError naming the URL."""
    if not is_url(path):
        return path
    root = os.fspath(cache_dir) if cache_dir is not None else cache_root()
    if expect is not None:
        key = "sha256-" + expect[1]
    else:
        info = _info(path)
        key = hashlib.sha256(f"{path}\n{info['size']}\n{_tag(info)}".encode()).hexdigest()[:32]
    target = os.path.join(root, key, _object_name(path))
    if os.path.isfile(target) and (expect is None or os.path.getsize(target) == expect[0]):
        return target
    _download(path, target, expect)
    return target
