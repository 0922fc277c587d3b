"""Where a packing run writes: a local directory or a prefix on object storage (gs://, s3://...).

The writer (and the Beam job) speak to an `OutputDir` only, so both kinds work the same way:

    local directory          object storage (fsspec)
    ---------------          -----------------------
    shard: write name.tmp,   shard: write a local staging file, upload it when complete (an
      rename when complete     object appears only whole; the store has no rename)
    JSON: temp + rename      JSON: one PUT (an object is replaced whole, never half written)
    lock: O_CREAT|O_EXCL     lock: a create-if-absent write (S3 If-None-Match, GCS
                               ifGenerationMatch=0), after a read that refuses a live owner

Objects are listed without a cache, so what another process wrote is seen.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

from seqpack.pipelines import storage
from seqpack.pipelines.errors import InputError, UsageError
from seqpack.pipelines.formats import manifest as manifest_io


class OutputDir:
    """A run's output location; `remote` when it is a URL prefix."""

    def __init__(self, location: str | os.PathLike, *, stage: str | None = None):
        self.location = os.fspath(location)
        self.remote = storage.is_url(self.location)
        self._stage = stage  # a remote location's local staging directory (shared by workers)
        self._own_stage = False

    def __repr__(self) -> str:
        return f"OutputDir({self.location!r})"

    def path(self, name: str) -> str:
        return storage.join(self.location, name) if self.remote \
            else os.path.join(self.location, name)

    def _fs(self) -> tuple[Any, str]:
        fs, inside = storage.filesystem(self.location.rstrip("/") + "/")
        return fs, inside.rstrip("/")

    # -- reading ----------------------------------------------------------------------------

    def check_usable(self) -> None:
        """UsageError when the location is a file (an object), not a directory (a prefix)."""
        if self.remote:
            if storage.exists(self.location.rstrip("/")):
                raise UsageError(f"{self.location}: is an object, not a prefix")
        elif os.path.exists(self.location) and not os.path.isdir(self.location):
            raise UsageError(f"{self.location}: exists and is not a directory")

    def names(self) -> list[str]:
        """The names directly under the location (sorted); none for a missing one."""
        if not self.remote:
            return sorted(os.listdir(self.location)) if os.path.isdir(self.location) else []
        fs, inside = self._fs()
        try:
            found = fs.ls(inside, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted({p.rstrip("/").rsplit("/", 1)[-1] for p in found
                       if p.rstrip("/") != inside})

    def exists(self, name: str) -> bool:
        return storage.exists(self.path(name)) if self.remote \
            else os.path.exists(self.path(name))

    def read_json(self, name: str) -> Any:
        if not self.remote:
            return manifest_io.read_json(self.path(name))
        try:
            return json.loads(storage.read_bytes(self.path(name)))
        except ValueError as e:
            raise InputError(f"{self.path(name)}: not valid JSON ({e})") from None

    def digest(self, name: str) -> tuple[int, str] | None:
        """(size, sha256) of an object or file; None if there is none."""
        if not self.remote:
            path = self.path(name)
            return manifest_io.file_digest(path) if os.path.isfile(path) else None
        fs, inside = self._fs()
        h = hashlib.sha256()
        size = 0
        try:
            with fs.open(f"{inside}/{name}", "rb", block_size=8 << 20) as f:
                while block := f.read(8 << 20):
                    h.update(block)
                    size += len(block)
        except FileNotFoundError:
            return None
        return size, h.hexdigest()

    # -- writing ----------------------------------------------------------------------------

    def makedirs(self) -> bool:
        """Creates a local directory (True if it was not there); a prefix needs nothing."""
        if self.remote or os.path.isdir(self.location):
            return False
        os.makedirs(self.location)
        return True

    def write_json(self, name: str, obj: Any) -> None:
        """Replaces `name` whole: a reader sees the old content or the new, never a part."""
        if not self.remote:
            manifest_io.write_json(self.path(name), obj)
            return
        fs, inside = self._fs()
        fs.pipe(f"{inside}/{name}", _json_bytes(obj))

    def create_json(self, name: str, obj: Any) -> bool:
        """Writes `name` only if it does not exist; False if it does."""
        data = _json_bytes(obj)
        if not self.remote:
            try:
                fd = os.open(self.path(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return True
        fs, inside = self._fs()
        if fs.exists(f"{inside}/{name}"):
            return False
        try:
            fs.pipe(f"{inside}/{name}", data, mode="create")
        except (FileExistsError, OSError) as e:
            if isinstance(e, FileExistsError) or "precondition" in str(e).lower():
                return False
            raise
        return True

    def remove(self, name: str) -> None:
        if not self.remote:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path(name))
            return
        fs, inside = self._fs()
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(f"{inside}/{name}")

    def staging(self) -> str:
        """A local directory for files being written (the directory itself when local)."""
        if not self.remote:
            return self.location
        if self._stage is None:
            self._stage = tempfile.mkdtemp(prefix="seqpack-stage-")
            self._own_stage = True
        return self._stage

    def publish(self, local: str, name: str) -> None:
        """Makes a complete local file `name` here: a rename, or an upload (then removed)."""
        if not self.remote:
            os.replace(local, self.path(name))
            return
        fs, inside = self._fs()
        fs.put_file(local, f"{inside}/{name}")
        os.remove(local)

    def close(self) -> None:
        """Removes the staging directory this object made for a remote location."""
        if self._own_stage and self._stage is not None:
            shutil.rmtree(self._stage, ignore_errors=True)
            self._stage = None
            self._own_stage = False


def _json_bytes(obj: Any) -> bytes:
    """The bytes `formats.manifest.write_json` writes."""
    return (json.dumps(obj, indent=2) + "\n").encode()
