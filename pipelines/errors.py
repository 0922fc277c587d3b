"""The errors of seqpack's pipelines: bad input data, and optional dependencies not installed.

- `InputError` (from `seqpack.packer`): bad data; the message names the file and the line or
  record. The CLI prints it as one `Error:` line and exits with 2.
- `UsageError` (a ValueError): a bad argument or combination found while running (an output
  directory that exists without --overwrite, a --resume of a different run, a Beam option that
  is not KEY=VALUE). The CLI treats it like bad input.
- `MissingDependency` (an ImportError): an optional package is not installed; the message names
  the package and the extra that brings it (`pip install 'seqpack[io]'`).

Anything else (a plain ValueError from deep inside, a KeyError, ...) is a bug, not bad input.
"""

from __future__ import annotations

import importlib
import types

from seqpack.packer.inputs import InputError

__all__ = ["InputError", "MissingDependency", "UsageError", "require"]

# import name -> (distribution, the seqpack extra that installs it; None: the core install)
_PACKAGES = {
    "pyarrow": ("pyarrow", "io"),
    "array_record": ("array-record", None),
    "tokenizers": ("tokenizers", "text"),
    "matplotlib": ("matplotlib", "plotting"),
    "apache_beam": ("apache-beam", "beam"),
    "grain": ("grain", "grain"),
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
    top = module.split(".")[0]
    package, extra = _PACKAGES.get(top, (top, None))
    target = f"'seqpack[{extra}]'" if extra else "seqpack (it is a core dependency)"
    return f"{package}: pip install {target}"


def require(module: str, what: str) -> types.ModuleType:
    """Imports `module`, or raises MissingDependency: "{what} needs {package}: pip install ..."."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependency(f"{what} needs {install_hint(module)} ({e})") from None
