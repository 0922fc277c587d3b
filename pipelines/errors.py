"""The errors of seqpack's pipelines: bad input data, and optional dependencies not installed.

- `InputError` (from `seqpack.packer`): bad data; the message names the file and the line or
  record. The CLI prints it as one `Error:` line and exits with 2.
- `UsageError` (a ValueError): a bad argument or combination found while running (an output
  directory that is not empty, a resume of a different run, a Beam option that is not
  KEY=VALUE). The CLI treats it like bad input.
- `MissingDependency` (an ImportError): an optional package is not installed; the message names
  the package and the extra that brings it (`pip install 'seqpack[beam]'`, from a clone
  `pip install '.[beam]'`).
- `RunFailed` (an OSError): the system stopped a run (a disk full or out of inodes, no
  permission, a worker process killed); the message names the file and what to do, and the
  output is left in a state that `seqpack pack ... --resume` finishes. The CLI exits with 2.

Anything else (a plain ValueError from deep inside, a KeyError, ...) is a bug, not bad input.

Messages name a parameter the way a Python caller passes it: `name=` or `name=value`
(`shard_rows=1024`, `pads['labels']=...`, `existing='resume'`), never a CLI flag; the CLI
rewrites those names into its flags in one place (`pipelines.console.to_flags`).
"""

from __future__ import annotations

import errno
import importlib
import types

from seqpack.packer.inputs import InputError

__all__ = ["InputError", "MissingDependency", "RunFailed", "UsageError", "one_line", "require"]

# import name -> (distribution, the seqpack extra that installs it; None: the core install)
_PACKAGES = {
    "pyarrow": ("pyarrow", None),
    "array_record": ("array-record", None),
    "tokenizers": ("tokenizers", "text"),
    "matplotlib": ("matplotlib", "plotting"),
    "apache_beam": ("apache-beam", "beam"),
    "pyspark": ("pyspark", "spark"),
    "grain": ("grain", None),
    "jax": ("jax", "jax"),
    "fsspec": ("fsspec", "cloud"),
    "gcsfs": ("gcsfs", "cloud"),
    "s3fs": ("s3fs", "cloud"),
}


class UsageError(ValueError):
    """A bad argument (or combination), found while running; the message says the fix."""


class MissingDependency(ImportError):
    """An optional dependency is missing; the message says which extra to install."""


def install_hint(module: str) -> str:
    """"package: <the command that installs it>", for a wheel and for a clone of the
    repository (all extras: `seqpack[all]`)."""
    top = module.split(".")[0]
    package, extra = _PACKAGES.get(top, (top, None))
    if extra is None:
        return f"{package}: pip install seqpack (it is a core dependency; from a clone: pip " \
            "install .)"
    return f"{package}: pip install 'seqpack[{extra}]' (from a clone: pip install '.[{extra}]')"


def require(module: str, what: str) -> types.ModuleType:
    """Imports `module`, or raises MissingDependency: "{what} needs {package}: pip install ..."."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependency(f"{what} needs {install_hint(module)} ({e})") from None


def one_line(e: BaseException) -> str:
    """An error's message on one line (white space folded), or its type's name."""
    return " ".join(str(e).split()) or type(e).__name__


# What to do about an error the system raised, by errno; matched by message for the RuntimeErrors
# of array_record, which carry the C library's text.
_ADVICE = {
    errno.ENOSPC: ("No space left on device", "free space on that disk (or write elsewhere)"),
    errno.EDQUOT: ("Disk quota exceeded", "free space within the quota"),
    errno.EFBIG: ("File too large", "raise the file size limit (ulimit -f) or pass a smaller "
                  "shard_rows="),
    errno.EACCES: ("Permission denied", "make it writable"),
    errno.EPERM: ("Operation not permitted", "make it writable"),
    errno.EROFS: ("Read-only file system", "write to a writable file system"),
    errno.EMFILE: ("Too many open files", "raise the open file limit (ulimit -n)"),
}


class RunFailed(OSError):
    """The system stopped a run; the message names the file and what to do (see the module)."""

    @classmethod
    def of(cls, e: BaseException, path: str, what: str) -> RunFailed:
        """`path: what (reason); advice`, from the OSError / RuntimeError `e`."""
        if isinstance(e, RunFailed):
            return e
        code = e.errno if isinstance(e, OSError) else None
        reason = e.strerror if isinstance(e, OSError) and e.strerror else one_line(e)
        known = code if code in _ADVICE else next(
            (k for k, (text, _) in _ADVICE.items() if text.lower() in reason.lower()), None)
        advice = _ADVICE[known][1] if known is not None else ""
        if code is None and known is not None:  # a RuntimeError quoting the C library's text
            code, reason = known, _ADVICE[known][0]
        return cls(code or 0, f"{path}: {what} ({reason})" + (f"; {advice}" if advice else ""))

    def __str__(self) -> str:
        return str(self.args[1] if len(self.args) > 1 else self.args[0])
