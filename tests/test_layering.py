"""Layering: packer imports no jax/grain, the CLI no jax, kernels nothing from other layers."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    return {m.split(".")[0] for m in out.split()}


def test_packer_loads_neither_jax_nor_grain():
    loaded = _loaded_after("import packer")
    assert not loaded & {"jax", "jaxlib", "grain", "kernels", "pipelines"}, loaded


def test_cli_does_not_load_jax():
    loaded = _loaded_after("import cli")
    assert not loaded & {"jax", "jaxlib", "kernels"}, loaded


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_kernels_import_nothing_from_other_layers():
    for path in (ROOT / "kernels").glob("*.py"):
        bad = _imports(path) & {"packer", "pipelines", "grain", "cli"}
        assert not bad, f"{path.name} imports {bad}"


def test_packer_imports_only_numpy_and_stdlib():
    for path in (ROOT / "packer").rglob("*.py"):
        bad = _imports(path) & {"jax", "jaxlib", "grain", "pipelines", "kernels", "cli"}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
