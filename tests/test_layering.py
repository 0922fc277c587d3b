"""Layering: packer imports no jax/grain, the CLI and the offline job no jax, kernels nothing from
other layers, and only `pipelines/datasets/` imports grain."""

from __future__ import annotations

import ast
import os
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
    # Nothing of the project is importable under a generic top-level name (another
    # distribution's may be: transformers installs Hugging Face's `kernels`).
    for generic in ("packer", "pipelines", "kernels", "cli"):
        code = (f"import importlib.util as u; s = u.find_spec({generic!r}); "
                "print(s and (s.origin or next(iter(s.submodule_search_locations or []), '')))")
        out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True,
                             text=True, check=True).stdout.strip()
        assert out in ("None", "") or not os.path.realpath(out).startswith(
            str(ROOT / generic)), \
            f"{generic!r} is importable as a top-level module ({out})"


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
    ("seqpack.pipelines.datasets", "grain", "seqpack"),  # a core dependency
    ("seqpack.kernels", "jax", "'seqpack[jax]' (from a clone: pip install '.[jax]'"),
])
def test_a_layer_without_its_extra_says_which_extra(module, missing, extra):
    code = f"import sys; sys.modules[{missing!r}] = None; import {module}"
    result = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.split(":")[0].endswith(("ImportError", "MissingDependency")), last
    assert f"needs {missing}: pip install {extra}" in last, last


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


# -- the house: wings, sizes, private names ---------------------------------------------------

LIBRARY = [ROOT / "packer", ROOT / "kernels", ROOT / "pipelines", ROOT / "cli.py"]
LAYER_ROOTS = {"packer", "kernels", "pipelines", "pipelines/formats", "pipelines/offline",
               "pipelines/datasets"}
MAX_MODULES, MAX_LINES, MAX_FUNCTION = 12, 450, 80


def _library_files() -> list[pathlib.Path]:
    out = []
    for place in LIBRARY:
        out += [place] if place.is_file() else sorted(place.rglob("*.py"))
    return out


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(("seqpack", *parts))


def _wings() -> list[str]:
    """Packages below the layers' roots: each a wing whose modules only it imports."""
    packages = [p.parent for place in LIBRARY if place.is_dir()
                for p in place.rglob("__init__.py")]
    return sorted(_module_name(p / "__init__.py") for p in packages
                  if p.relative_to(ROOT).as_posix() not in LAYER_ROOTS)


WINGS = _wings()


def _from_imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []


def test_pyproject_ships_every_package():
    """A non-editable install (`pip install .`) ships exactly the packages pyproject lists."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {"seqpack"} | {_module_name(p) for place in LIBRARY if place.is_dir()
                           for p in place.rglob("__init__.py")}
    assert listed == found, (sorted(found - listed), sorted(listed - found))


def test_wings_are_known():
    for wing in ("seqpack.packer.online", "seqpack.packer.order",
                 "seqpack.packer.strategies.bfd", "seqpack.packer.strategies.bfd.refine",
                 "seqpack.kernels.tpu", "seqpack.kernels.gpu", "seqpack.kernels.fused",
                 "seqpack.pipelines.offline.runners", "seqpack.pipelines.formats.encodings"):
        assert wing in WINGS, WINGS


@pytest.mark.parametrize("path", _library_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_wing_is_entered_only_through_its_package(path):
    """Code outside a wing imports the wing's package (its __init__), never its modules; inside,
    a wing imports nothing from a sibling wing's modules either."""
    me = _module_name(path)
    for module, _ in _from_imports(path):
        for wing in WINGS:
            inside = module.startswith(wing + ".") and module.count(".") == wing.count(".") + 1
            if inside and not (me == wing or me.startswith(wing + ".")):
                pytest.fail(f"{path.relative_to(ROOT)} imports {module}: import {wing} instead")


@pytest.mark.parametrize("path", _library_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_private_name_is_imported_across_modules(path):
    for module, names in _from_imports(path):
        if module.split(".")[0] == "seqpack":
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            assert not private, f"{path.relative_to(ROOT)} imports {private} from {module}"


def test_every_folder_holds_at_most_twelve_modules():
    folders = {p.parent for p in _library_files() if p.parent != ROOT}
    for folder in sorted(folders):
        count = len(list(folder.glob("*.py")))
        assert count <= MAX_MODULES, f"{folder.relative_to(ROOT)} holds {count} modules"


@pytest.mark.parametrize("path", _library_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_modules_and_functions_stay_small(path):
    source = path.read_text()
    assert source.count("\n") <= MAX_LINES, f"{path.relative_to(ROOT)}: {source.count(chr(10))}"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = node.end_lineno - node.lineno + 1
            assert lines <= MAX_FUNCTION, \
                f"{path.relative_to(ROOT)}:{node.lineno} {node.name} has {lines} lines"


@pytest.mark.parametrize("family,other", [("tpu", "gpu"), ("gpu", "tpu")])
def test_the_kernel_families_import_nothing_from_each_other(family, other):
    """The Mosaic and the Triton kernels share only the shared modules the package docstring
    names: kernels.common, .attention_schedule, .metadata (the layout a family declares) and
    .checks; never an op module."""
    shared = {f"seqpack.kernels.{m}" for m in ("common", "attention_schedule", "metadata",
                                                "checks")}
    for path in sorted((ROOT / "kernels" / family).glob("*.py")):
        for module, _ in _from_imports(path):
            assert not module.startswith(f"seqpack.kernels.{other}"), (path, module)
            if module.startswith("seqpack.kernels") and not module.startswith(
                    f"seqpack.kernels.{family}"):
                assert module in shared, (path, module)
