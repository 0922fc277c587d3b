"""One writer per output: the lock of a packing run (`DirLock`), on a directory or a prefix.

``pack.lock`` names its owner (pid, host, process start time) and is removed when the run ends.
On a local directory it is held with `flock`, which the kernel releases however the owner dies,
so taking a killed run's lock over is one atomic step; on object storage it is an object created
only if absent, replaced only if still the one that was read (see `DirLock`).
"""

from __future__ import annotations

import json
import os
import socket

from seqpack.pipelines import storage
from seqpack.pipelines.errors import UsageError
from seqpack.pipelines.offline.outdir import LOCK, OutputDir, as_output_dir


class DirLock:
    """One writer per output: ``pack.lock`` holds the owner's pid, host and process start time
    and is removed when the run ends.

    Local directory: the lock is an `flock` on ``pack.lock``, which the kernel releases when its
    owner dies however it dies, so taking over a killed run's lock is one atomic step: of many
    runs started together, exactly one gets it, and the others are refused (never both, never
    one removing the other's fresh lock). After the flock, the file must still be the one at
    the path (a run that ends removes it). A lock whose file names another host is never taken
    (a shared filesystem whose flock does not reach across hosts): the error says how to clear it.

    Object storage (no flock): the lock is an object created only if absent (S3 If-None-Match,
    GCS ifGenerationMatch=0). Taking over a stale one (its owner, on this host, is gone) replaces
    it only if it is still the object that was read (S3 If-Match on its ETag; elsewhere a
    delete and a create-if-absent, so two racers cannot both create it)."""

    def __init__(self, directory: str | OutputDir):
        self.out = as_output_dir(directory)
        self.path = self.out.path(LOCK)
        self.held = False
        self._fd: int | None = None

    def __enter__(self) -> DirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": storage.process_start_time()}
        if self.out.remote:
            self._acquire_object(me)
        else:
            self._acquire_file(me)
        self.held = True

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            self.out.remove(LOCK)  # while the flock is held: no one can take the old file
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _busy(self, owner: dict | None) -> UsageError:
        owner = owner or {}
        return UsageError(f"{self.out.location}: another seqpack run (pid {owner.get('pid')} on "
                          f"{owner.get('host')}) is writing here; wait for it, or remove "
                          f"{self.path} if that run is gone")

    def _acquire_file(self, me: dict) -> None:
        import fcntl

        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _parse_owner(_read_fd(fd))
                os.close(fd)
                raise self._busy(owner) from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if not same:  # the run that held it removed it meanwhile: take the new file
                os.close(fd)
                continue
            owner = _parse_owner(_read_fd(fd))
            if owner is not None and not _stale(owner) and owner.get("pid") != os.getpid():
                os.close(fd)  # a live owner that holds no flock (another host, an old seqpack)
                raise self._busy(owner)
            data = json.dumps(me).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            self._fd = fd
            return
        raise UsageError(f"{self.path}: could not take the lock (other runs keep taking it)")

    def _acquire_object(self, me: dict) -> None:
        for _ in range(3):
            if self.out.create_json(LOCK, me):
                return
            owner, version = self.out.read_versioned(LOCK)
            owner = owner if isinstance(owner, dict) else None
            if owner is not None and not _stale(owner):
                raise self._busy(owner)
            if self.out.replace_json_if(LOCK, me, version):  # stale: the owner is gone
                return
        raise UsageError(f"{self.path}: could not take the lock (another run keeps taking it); "
                         "if no seqpack run is writing here, remove it")


def _read_fd(fd: int) -> bytes:
    return os.pread(fd, 1 << 16, 0)


def _parse_owner(data: bytes) -> dict | None:
    try:
        owner = json.loads(data) if data.strip() else None
    except ValueError:
        return None
    return owner if isinstance(owner, dict) else None


def _stale(owner: dict) -> bool:
    if owner.get("host") != socket.gethostname():
        return False
    pid = owner.get("pid")
    return not isinstance(pid, int) or storage.process_gone(pid, owner.get("started"))
