"""Inputs as users hold them (`expand_inputs`, used by the CLI): directories, quoted local
globs, and a file given twice refused unless allowed."""

from __future__ import annotations

import functools
import json
import os

import pytest

from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats.paths import expand_inputs, is_output_dir
from tests.helpers import files
from tests.helpers.files import write_jsonl
from tests.test_cli_errors import assert_bad_input

invoke = functools.partial(files.invoke, ok=False)


@pytest.fixture
def data(tmp_path):
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    for name in ("b.jsonl", "a.jsonl", "c.jsonl.gz", "d.array_record-00000-of-00001",
                 "README.md", "_SUCCESS", ".hidden.jsonl", "sub/e.jsonl"):
        (d / name).write_text("")
    write_jsonl(d / "a.jsonl", [[1, 2], [3]])
    write_jsonl(d / "b.jsonl", [[4]])
    return d


def test_a_directory_gives_its_input_files_sorted(data):
    names = ["a.jsonl", "b.jsonl", "c.jsonl.gz", "d.array_record-00000-of-00001"]
    assert expand_inputs([str(data)]) == [str(data / n) for n in names]
    assert expand_inputs([str(data / "*.jsonl")]) == [str(data / "a.jsonl"),
                                                     str(data / "b.jsonl")]
    assert expand_inputs([str(data / "**" / "e.jsonl")]) == [str(data / "sub" / "e.jsonl")]
    with pytest.raises(InputError, match=r"no files match"):
        expand_inputs([str(data / "*.parquet")])
    (data / "nested" / "deeper").mkdir(parents=True)
    with pytest.raises(InputError, match=r"nested: a directory with no input files .*"
                                         r"subdirectories are not read"):
        expand_inputs([str(data / "nested")])


def test_a_file_given_twice_is_refused_unless_allowed(data, monkeypatch):
    a = str(data / "a.jsonl")
    os.symlink(a, data / "link.jsonl")
    monkeypatch.chdir(data)
    for args in ([a, a], ["a.jsonl", "./a.jsonl"], [a, "link.jsonl"], [str(data), a]):
        with pytest.raises(InputError, match=r"given twice as an input.*allow_duplicates=True"):
            expand_inputs(args)
    assert expand_inputs([a, a], allow_duplicates=True) == [a, a]
    assert expand_inputs(["missing.jsonl", "other.jsonl"]) == ["missing.jsonl", "other.jsonl"]


def test_an_output_directory_is_not_an_input(tmp_path, data):
    out = tmp_path / "out"
    files.invoke("pack", data / "a.jsonl", "-o", out, "--seq-len", "8", "--workers", "1")
    assert is_output_dir(str(out)) and not is_output_dir(str(data))
    with pytest.raises(InputError, match="a seqpack output directory, not an input"):
        expand_inputs([str(out)])
    assert files.invoke("stats", out).exit_code == 0  # read as a whole, as before


def test_the_cli_takes_directories_and_globs_and_refuses_repeats(tmp_path, data):
    for name in ("c.jsonl.gz", "d.array_record-00000-of-00001"):
        os.remove(data / name)
    result = files.invoke("stats", data, "--seq-len", "8", "--json")  # a.jsonl + b.jsonl
    assert json.loads(result.output)["summary"]["best_fit"]["examples"] == 3
    assert_bad_input(invoke("pack", data / "a.jsonl", data / "a.jsonl", "-o", tmp_path / "o"),
                     "a.jsonl: given twice as an input")
    glob = str(data / "*.jsonl")
    files.invoke("pack", glob, "-o", tmp_path / "g", "--seq-len", "8", "--workers", "1")
    files.invoke("pack", data, "-o", tmp_path / "d", "--seq-len", "8", "--workers", "1")
    manifests = [json.loads((tmp_path / d / "manifest.json").read_text()) for d in "gd"]
    assert [[f["path"] for f in m["inputs"]["files"]] for m in manifests] == [
        [str(data / "a.jsonl"), str(data / "b.jsonl")]] * 2
    assert_bad_input(invoke("pack", tmp_path / "g", "-o", tmp_path / "o"),
                     "g: a seqpack output directory, not an input")


def test_a_directory_leaves_nothing_out_silently(data, caplog):
    # every file of a known format is read, "_" names too; what is left out is named, with why
    (data / "_strptime.txt").unlink(missing_ok=True)
    (data / "_part-0.jsonl").write_text("")
    with caplog.at_level("WARNING", logger="seqpack"):
        got = expand_inputs([str(data)])
    assert str(data / "_part-0.jsonl") in got and str(data / ".hidden.jsonl") not in got
    said = caplog.text
    assert f"{data / 'README.md'}: left out: no known input format by its name" in said
    assert f"{data / '_SUCCESS'}: left out: no known input format" in said
    assert f"{data / 'sub'}: left out: a directory" in said
    assert ".hidden.jsonl" not in said  # hidden files: left out as documented


def test_text_among_token_files_is_refused_unless_the_format_is_given(data, caplog):
    # a stray notes.txt among token-id files would be packed as UTF-8 bytes beside the ids
    (data / "notes.txt").write_text("some notes\n")
    with pytest.raises(InputError, match=r"notes\.txt: a text file among 4 token file\(s\) "
                                         r"\(arrayrecord, jsonl\).*input_format="):
        expand_inputs([str(data)])
    with caplog.at_level("WARNING", logger="seqpack"):
        got = expand_inputs([str(data)], input_format="jsonl")
    assert got == [str(data / n) for n in ("a.jsonl", "b.jsonl", "c.jsonl.gz")]
    assert f"{data / 'notes.txt'}: left out: not of input_format='jsonl'" in caplog.text
    assert expand_inputs([str(data)], input_format="text") == [str(data / "notes.txt")]
    # a folder of text files alone is read whole: "_" names (Python's __future__.py) included
    text = data.parent / "text"
    text.mkdir()
    for name in ("__future__.txt", "_strptime.txt", "abc.txt"):
        (text / name).write_text("x\n")
    assert expand_inputs([str(text)]) == [str(text / n) for n in
                                          ("__future__.txt", "_strptime.txt", "abc.txt")]
