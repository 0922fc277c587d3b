"""Benchmarks, run from the repository root as `python -m benchmarks.NAME`.

There the root is on `sys.path`, so its `kernels/`, `packer/` and `pipelines/` (seqpack's own,
imported as `seqpack.*`) would shadow installed packages of those names: Hugging Face's
`kernels`, which transformers imports for TRL's rows, failed on seqpack's. A finder makes
those names skip the root (`examples` and `tests` still come from it).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SEQPACK_DIRS = ("kernels", "packer", "pipelines")


class _BesideTheRepository(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001 - the finder protocol's
        if path is not None or name not in _SEQPACK_DIRS:
            return None
        elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]
        spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return spec


if not any(isinstance(f, _BesideTheRepository) for f in sys.meta_path):
    sys.meta_path.insert(0, _BesideTheRepository())
