"""Layering: packer imports no jax/grain, the CLI and the offline job no jax, kernels nothing from
other layers, and only `pipelines/datasets/` imports grain."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Repository folder -> the installed package it becomes (pyproject's package-dir).
FOLDERS = {
    "packer": "seqpack.packer",
    "kernels": "seqpack.kernels",
    "pipelines/formats": "seqpack.pipelines.formats",
    "pipelines/offline": "seqpack.pipelines.offline",
    "pipelines/datasets": "seqpack.pipelines.datasets",
}
HEAVY = {"jax", "jaxlib", "grain"}


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True,
                         check=True).stdout
    return set(out.split())


def _tops(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def _under(modules: set[str], package: str) -> set[str]:
    return {m for m in modules if m == package or m.startswith(package + ".")}


def test_one_import_root():
    loaded = _loaded_after("import seqpack.packer, seqpack.cli, seqpack.pipelines")
    assert "seqpack" in loaded
    # Nothing of the project is importable under a generic top-level name.
    for generic in ("packer", "pipelines", "kernels", "cli"):
        code = f"import importlib.util as u; print(u.find_spec({generic!r}) is None)"
        out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True,
                             text=True, check=True).stdout.strip()
        assert out == "True", f"{generic!r} is importable as a top-level module"


def test_packer_loads_neither_jax_nor_grain():
    loaded = _loaded_after("import seqpack.packer")
    assert not _tops(loaded) & HEAVY, loaded
    assert not _under(loaded, "seqpack.kernels") | _under(loaded, "seqpack.pipelines")


def test_cli_and_offline_job_do_not_load_jax_or_grain():
    statement = ("import seqpack.cli, seqpack.pipelines.offline.runners, "
                 "seqpack.pipelines.offline.verify, seqpack.pipelines.offline.report, "
                 "seqpack.pipelines.formats.inputs, seqpack.pipelines.formats.manifest")
    loaded = _loaded_after(statement)
    assert not _tops(loaded) & HEAVY, sorted(_tops(loaded) & HEAVY)
    assert not _under(loaded, "seqpack.kernels") | _under(loaded, "seqpack.pipelines.datasets")


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _forbidden(folder: str) -> set[str]:
    """Top-level names and seqpack packages a folder must not import."""
    if folder == "packer":
        return HEAVY | {"seqpack.kernels", "seqpack.pipelines", "seqpack.cli"}
    if folder == "kernels":
        return {"grain", "seqpack.packer", "seqpack.pipelines", "seqpack.cli"}
    if folder in ("pipelines/formats", "pipelines/offline"):
        return HEAVY | {"seqpack.kernels", "seqpack.pipelines.datasets", "seqpack.cli"}
    return {"seqpack.kernels", "seqpack.cli", "seqpack.pipelines.offline"}


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_folders_import_only_their_layers(folder):
    bad_names = _forbidden(folder)
    for path in (ROOT / folder).rglob("*.py"):
        for name in _imports(path):
            hit = [b for b in bad_names if name == b or name.startswith(b + ".")]
            assert not hit, f"{path.relative_to(ROOT)} imports {name}"
            assert name.split(".")[0] not in {"packer", "pipelines", "kernels", "cli"}, \
                f"{path.relative_to(ROOT)} imports {name}: import it as seqpack.{name}"


@pytest.mark.parametrize("module,missing,extra", [
    ("seqpack.pipelines.datasets", "grain", "seqpack[grain]"),
    ("seqpack.kernels", "jax", "seqpack[jax]"),
])
def test_a_layer_without_its_extra_says_which_extra(module, missing, extra):
    code = f"import sys; sys.modules[{missing!r}] = None; import {module}"
    result = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.split(":")[0].endswith(("ImportError", "MissingDependency")), last
    assert f"needs {missing}: pip install '{extra}'" in last, last


CLOUD = {"fsspec", "gcsfs", "s3fs", "botocore", "aiobotocore", "google"}


def test_object_storage_clients_load_only_when_a_url_is_used():
    """pipelines/storage.py imports fsspec and gcsfs/s3fs when it meets a URL: the core
    install, the CLI's --help and local paths never load them."""
    code = ("import sys, contextlib, seqpack.cli, seqpack.pipelines.storage as s, "
            "seqpack.pipelines.formats.inputs, seqpack.pipelines.offline.verify\n"
            "with contextlib.suppress(SystemExit):\n"
            "    seqpack.cli.main(['--help'])\n"
            "assert s.expand(['a.jsonl', 'x/*.parquet']) == ['a.jsonl', 'x/*.parquet']\n"
            "print('MODULES', *sorted(sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True,
                         check=True).stdout
    loaded = set(out.split("MODULES", 1)[1].split())
    assert "seqpack.pipelines.storage" in loaded
    assert not _tops(loaded) & CLOUD, sorted(_tops(loaded) & CLOUD)
