"""docs/contract.md agrees with the packer: its worked example is re-packed and compared."""

from __future__ import annotations

import ast
import pathlib
import re

import numpy as np
import pytest

from seqpack.packer import PackConfig, contract, pack, segment_ids_and_positions, validate

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "contract.md"
KEYS = (
    "tokens",
    "tokens_segment_ids",
    "tokens_positions",
    "tokens_segment_lengths",
    "tokens_segment_offsets",
    "segment_source_index",
    "segment_source_start",
)
_MARKER = re.compile(r"<!-- worked-example: (.*?) -->\s*```text\n(.*?)```", re.S)


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text(encoding="utf-8")


def _config_from_call(call: str) -> PackConfig:
    """The `PackConfig(...)` inside the marker's call, built from its literal arguments."""
    for node in ast.walk(ast.parse(call, mode="eval")):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "PackConfig":
            args = [ast.literal_eval(a) for a in node.args]
            kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            return PackConfig(*args, **kwargs)
    raise AssertionError(f"no PackConfig(...) in the worked-example marker: {call!r}")


def _worked_example(doc: str) -> tuple[str, PackConfig, list[np.ndarray], dict[str, list]]:
    """(call, config, examples, key -> list of per-row int lists) parsed from the doc."""
    found = _MARKER.findall(doc)
    assert len(found) == 1, "docs/contract.md needs exactly one <!-- worked-example: ... --> block"
    call, block = found[0]
    config = _config_from_call(call)
    lines = block.splitlines()
    ex_lines = [line for line in lines if line.startswith("examples")]
    assert len(ex_lines) == 1, "the worked example needs one 'examples' line"
    named = re.findall(r"(e\d+) = \[([-\d ]*)\]", ex_lines[0])
    assert [name for name, _ in named] == [f"e{i}" for i in range(len(named))]
    assert re.findall(r"\be\d+\b", call) == [name for name, _ in named], (
        "the marker's call and the 'examples' line name different examples")
    examples = [np.array([int(t) for t in body.split()], np.int32) for _, body in named]
    arrays: dict[str, list] = {}
    for line in lines:
        key, _, rest = line.partition(" ")
        if key in KEYS:
            assert key not in arrays, f"{key} appears twice in the worked example"
            arrays[key] = [[int(t) for t in part.split()] for part in rest.split("|")]
    return call, config, examples, arrays


def test_worked_example_matches_packer(doc):
    _, config, examples, arrays = _worked_example(doc)
    batch = pack(examples, config)
    assert sorted(arrays) == sorted(batch), "the worked example must show every key of the batch"
    for key, rows in arrays.items():
        np.testing.assert_array_equal(np.array(rows), batch[key], err_msg=key)
    validate(batch, config)


def test_worked_example_shows_split_and_gap(doc):
    _, config, _, arrays = _worked_example(doc)
    assert config.overflow == "split" and config.segment_alignment > 1
    assert len(arrays["tokens"]) == 2
    assert any(s > 0 for row in arrays["segment_source_start"] for s in row)
    gap = [(r, i) for r, row in enumerate(arrays["tokens_segment_ids"])
           for i in range(1, len(row) - 1) if row[i] == 0 and row[i - 1] and row[i + 1]]
    assert gap, "the worked example should show an alignment gap between two segments"


def test_worked_example_ids_and_positions_rebuild_from_metadata(doc):
    _, config, _, arrays = _worked_example(doc)
    ids, pos = segment_ids_and_positions(
        np.array(arrays["tokens_segment_lengths"]),
        np.array(arrays["tokens_segment_offsets"]),
        config.seq_len,
    )
    np.testing.assert_array_equal(ids, np.array(arrays["tokens_segment_ids"]))
    np.testing.assert_array_equal(pos, np.array(arrays["tokens_positions"]))


def test_key_table_dtypes_match_packer(doc):
    _, config, examples, _ = _worked_example(doc)
    batch = pack(examples, config)
    rows = re.findall(r"^\| `(\w+)` \| `\[([LS])\]`,? (\w+)", doc, re.M)
    assert len(rows) == len(KEYS) + 1, "the key table should have one line per contract key"
    for name, dim, dtype in rows:
        if name == contract.DATASET_ID:  # rows of a mixture only: the contract's own dtype
            assert (dim, contract.DATASET_DTYPE) == ("S", np.dtype(f"int{dtype[1:]}"))
            continue
        key = name if name.startswith("segment_") else "tokens" + name[1:]
        assert batch[key].shape[-1] == {"L": config.seq_len, "S": config.max_segments}[dim], name
        if dtype in ("i32", "i64"):
            assert batch[key].dtype == np.dtype(f"int{dtype[1:]}"), name


def test_doc_names_every_key_and_stays_inside_the_repository(doc):
    for key in KEYS:
        assert f"`{key}`" in doc or re.search(rf"^{key} ", doc, re.M), key
    assert "../shared" not in doc
    assert "DESIGN.md" not in doc
