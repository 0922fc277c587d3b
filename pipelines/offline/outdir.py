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

What a run keeps there, and trusts only after checking, also lives here: the intent and
manifest (`check_dir`, `prepare_dir`, `commit_manifest`; `run_state` says which a run left)
and each shard's completion record (`shard_done`). The run's lock is `offline.lock.DirLock`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from typing import Any

from seqpack.pipelines import storage
from seqpack.pipelines.errors import InputError, RunFailed, UsageError
from seqpack.pipelines.formats import manifest as manifest_io
from seqpack.pipelines.formats.encodings import ENCODINGS, is_side_file
from seqpack.pipelines.formats.manifest import INTENT, MANIFEST, Manifest

DONE = ".done"  # a shard's completion record: rows-....arrayrecord.done
LOCK = "pack.lock"
ERROR = "pack_error.json"  # the Beam job's report of a rejected input (read by its driver)


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
        """Creates a local directory (True if it was not there); a prefix on object storage
        needs nothing, a file:// URL its directory."""
        if self.remote:
            fs, inside = self._fs()
            if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
                fs.makedirs(inside, exist_ok=True)
            return False
        if os.path.isdir(self.location):
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
            if isinstance(e, FileExistsError) or _precondition_failed(e):
                return False
            raise
        return True

    def read_versioned(self, name: str) -> tuple[Any, str | None]:
        """(JSON content, version) of an object: the version (S3 ETag, GCS generation) read
        before and after the content, so the two belong together; (None, None) if missing."""
        fs, inside = self._fs()
        key = f"{inside}/{name}"
        for _ in range(5):
            try:
                before = _version(fs.info(key, refresh=True))
                data = fs.cat_file(key)
                after = _version(fs.info(key, refresh=True))
            except FileNotFoundError:
                return None, None
            if before == after:
                try:
                    return json.loads(data), before
                except ValueError:
                    return None, before
        return None, None

    def replace_json_if(self, name: str, obj: Any, version: str | None) -> bool:
        """Replaces object `name` with `obj` only if it is still at `version` (None: only if
        it is absent); False if another writer changed it first."""
        if version is None:
            return self.create_json(name, obj)
        fs, inside = self._fs()
        bucket, _, key = f"{inside}/{name}".partition("/")
        try:
            if type(fs).__name__ == "S3FileSystem":
                fs.call_s3("put_object", Bucket=bucket, Key=key, Body=_json_bytes(obj),
                           IfMatch=version)
                fs.invalidate_cache()
                return True
            if type(fs).__name__ == "GCSFileSystem":
                fs.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=version)
            else:  # no precondition to lean on: delete, then create if absent
                fs.rm_file(f"{inside}/{name}")
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001 - each client has its own precondition error
            if _precondition_failed(e):
                return False
            raise
        fs.invalidate_cache()
        return self.create_json(name, obj)

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
            self._stage = storage.scratch_dir("stage")
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


def _precondition_failed(e: BaseException) -> bool:
    """Whether a store refused a conditional write (HTTP 412, in each client's words)."""
    text = str(e).lower().replace("-", "")
    return "412" in text or "precondition" in text


def _version(info: dict) -> str:
    """An object's version: S3's ETag, GCS's generation; elsewhere (file://, memory://) its
    size and modification time, which only tells a read's content from a write in between
    (`replace_json_if` then deletes and creates if absent)."""
    version = info.get("ETag") or info.get("etag") or info.get("generation")
    if version is None:
        when = info.get("mtime") or info.get("created") or info.get("LastModified")
        version = f"{info.get('size')}@{when}"
    return str(version)


def _json_bytes(obj: Any) -> bytes:
    """The bytes `formats.manifest.write_json` writes."""
    return (json.dumps(obj, indent=2) + "\n").encode()


# -- what a run keeps in its output location --------------------------------------------------


def commit_manifest(output_dir: str | OutputDir, intent: Manifest, shard_num_rows: list[int],
                    results: dict, digests: list[tuple[int, str]]) -> Manifest:
    """Writes ``manifest.json`` (from here on the run is complete), then drops the intent and
    the shards' completion records."""
    out = as_output_dir(output_dir)
    manifest = intent.completed(shard_num_rows, results, digests)
    out.write_json(MANIFEST, manifest.to_json())
    out.remove(INTENT)
    for name in intent.shards:
        out.remove(name + DONE)
    _remove_shard_temporaries(out)
    return manifest


def _remove_shard_temporaries(out: OutputDir) -> None:
    """Removes what shard writes that died mid-way left in a local directory (``name.<attempt>
    .tmp``: a task Spark retried after its executor was killed); nothing else writes there
    while the run holds the lock. A remote output's temporaries are in local staging."""
    if out.remote:
        return
    for name in out.names():
        if name.startswith("rows-") and name.endswith(".tmp"):
            out.remove(name)


def as_output_dir(output_dir: str | OutputDir) -> OutputDir:
    return output_dir if isinstance(output_dir, OutputDir) else OutputDir(output_dir)


_SHARD_SUFFIXES = tuple(sorted({e.suffix for e in ENCODINGS.values()}))


def _owned(name: str) -> bool:
    """Whether a run writes `name`: a shard of any encoding (with its completion record or a
    temporary), a side file, the manifest or the intent."""
    return name.startswith("rows-") and any(s in name for s in _SHARD_SUFFIXES) \
        or is_side_file(name) or name in (MANIFEST, INTENT, MANIFEST + ".tmp", INTENT + ".tmp")


def check_dir(output_dir: str | OutputDir, *, overwrite: bool, resume: bool) -> list[str]:
    """Refuses what `prepare_dir` would refuse whatever the run; returns the directory's names.

    Called before the inputs are read, so a wrong directory fails at once."""
    out = as_output_dir(output_dir)
    if overwrite and resume:
        raise UsageError("pass either overwrite=True or resume=True, not both")
    out.check_usable()
    output_dir = out.location
    names = [n for n in out.names() if n not in (LOCK, ERROR)]
    recorded = [n for n in (MANIFEST, INTENT) if n in names]
    if not (resume and recorded) and names and not overwrite \
            and any(not n.endswith(".tmp") for n in names):
        hint = "existing='overwrite' to replace it" + (
            "" if resume else " or existing='resume' to finish an interrupted run")
        what = "holds no interrupted run to resume" if resume else "exists and is not empty"
        raise UsageError(f"{output_dir}: {what}; pass {hint}")
    return names


def run_state(location: str) -> str:
    """What runs left at `location`: "interrupted" (an intent: `existing='resume'` finishes the
    run), "complete" (a manifest and no intent) or "none" (neither: nothing was written)."""
    if storage.exists(storage.join(location, INTENT)):
        return "interrupted"
    return "complete" if storage.exists(storage.join(location, MANIFEST)) else "none"


def prepare_dir(output_dir: str | OutputDir, intent: Manifest, *, overwrite: bool,
                resume: bool) -> Manifest | None:
    """Readies the directory; returns the finished manifest when resuming a complete run."""
    out = as_output_dir(output_dir)
    names = check_dir(out, overwrite=overwrite, resume=resume)
    out.makedirs()
    recorded = [n for n in (MANIFEST, INTENT) if n in names]
    if resume and recorded:
        path = out.path(recorded[0])
        try:
            old = Manifest.from_json(out.read_json(recorded[0]), path)
        except InputError as e:
            raise InputError(f"{e}; rerun with existing='overwrite'") from None
        _check_same_run(path, old.intent().to_json(), intent.to_json())
        if old.complete:  # the run had finished
            if INTENT in names:  # killed between writing the manifest and this cleanup
                out.remove(INTENT)
            if _demote_if_damaged(out, old) is None:
                return old
            names = out.names()
    for name in names:
        if _owned(name) and (overwrite or name.endswith(".tmp")):
            out.remove(name)
    out.write_json(INTENT, intent.to_json())
    return None


def _demote_if_damaged(out: OutputDir, manifest: Manifest) -> list[str] | None:
    """Re-hashes a complete run's shards; when some are missing or differ from the manifest,
    turns the run back into an interrupted one whose good shards are kept (their completion
    records written from the manifest) and returns the bad shards' names; None if all match."""
    digests = list(zip(manifest.shard_bytes or [], manifest.shard_sha256 or []))
    bad = [name for name, want in zip(manifest.shards, digests)
           if out.digest(name) != tuple(want)]
    if not bad:
        return None
    out.write_json(INTENT, manifest.intent().to_json())
    for name, rows, want in zip(manifest.shards, manifest.shard_num_rows or [], digests):
        if name not in bad:
            write_done(out, name, rows, tuple(want))  # type: ignore[arg-type]
    out.remove(MANIFEST)
    return bad


def _check_same_run(path: str, old: dict, new: dict) -> None:
    diff = [k for k in new if old.get(k) != new[k]]
    if "mixture" in diff and "selection" not in (old.get("mixture") or {"selection": 0}):
        diff[diff.index("mixture")] = "mixture (made by an older seqpack's selection)"
    if diff:
        raise UsageError(f"cannot resume: {', '.join(diff)} differ from the run recorded in "
                         f"{path}{_changed_input(old, new)}; rerun with existing='overwrite'")


def _changed_input(old: dict, new: dict) -> str:
    """' (input i, path: what differs)' for the first input file that differs, else ''."""
    was_tok, now_tok = ((d.get("inputs") or {}).get("tokenizer") or {} for d in (old, new))
    if was_tok != now_tok:
        return (f" (the tokenizer: {now_tok.get('path')}, the run had {was_tok.get('path')}"
                f"{', another file' if was_tok.get('sha256') != now_tok.get('sha256') else ''})")
    was = (old.get("inputs") or {}).get("files") or []
    now = (new.get("inputs") or {}).get("files") or []
    if len(was) != len(now):
        return f" ({len(now)} inputs, the run had {len(was)})"
    for i, (a, b) in enumerate(zip(was, now)):
        if a != b:
            keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            return f" (input {i}, {b.get('path')}: its {', '.join(keys)} changed)"
    return ""


def refuse_incomplete(out: OutputDir, shards: Sequence[str], written: Sequence[int],
                      planned: Sequence[int]) -> None:
    """RunFailed where the shards hold other [segments, tokens] than the plan placed: a runner
    lost or repeated records between the inputs and the shards. No shard is then kept (their
    completion records removed: a resumed run writes every one again)."""
    got, want = [int(x) for x in written], [int(x) for x in planned]
    if got == want:
        return
    for name in shards:
        out.remove(name + DONE)
    raise RunFailed(0, f"{out.location}: the shards hold {got[0]:,} segments of {got[1]:,} "
                    f"tokens, the plan placed {want[0]:,} of {want[1]:,}: the runner lost or "
                    "repeated records; no shard is kept and the manifest is not written")


def records_run(output_dir: str, intent: Manifest) -> bool:
    """Whether the output's pack_intent.json, or its complete manifest.json, is of `intent`."""
    out = OutputDir(output_dir)
    try:
        for name in (INTENT, MANIFEST):
            if out.exists(name) and Manifest.from_json(
                    out.read_json(name), out.path(name)).intent().to_json() == intent.to_json():
                return True
    except (OSError, ValueError):  # unreadable: not this run (prepare_dir reports it)
        pass
    finally:
        out.close()
    return False


def write_done(out: OutputDir, name: str, rows: int, digest: tuple[int, str]) -> None:
    """The completion record of a shard: written after the shard, whole."""
    out.write_json(name + DONE, {"rows": rows, "bytes": digest[0], "sha256": digest[1]})


def shard_done(output_dir: str | OutputDir, name: str, num_rows: int
               ) -> tuple[int, str] | None:
    """(size, sha256) of a shard that a run finished writing and that is intact: its completion
    record exists and matches the shard's content; None otherwise (the shard is rewritten)."""
    out = as_output_dir(output_dir)
    try:
        done = out.read_json(name + DONE)
    except (OSError, ValueError):  # missing, or not JSON (InputError is a ValueError)
        return None
    if not isinstance(done, dict) or done.get("rows") != num_rows:
        return None
    digest = out.digest(name)
    if digest is None or [done.get("bytes"), done.get("sha256")] != list(digest):
        return None
    return digest
