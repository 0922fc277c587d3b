"""Errors in the caller's words: the library names its parameters as a Python caller passes them
(`shard_rows=33`, `pads['labels']=...`, `existing='resume'`), the CLI rewrites them into its flags
in one place (`pipelines.console.to_flags`, by the table `FLAGS`), and the table covers every
parameter the library's messages name."""

from __future__ import annotations

import ast
import errno
import pathlib
import re
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from seqpack.packer import PackConfig
from seqpack.pipelines.console import FLAGS, to_flags
from seqpack.pipelines.errors import RunFailed
from seqpack.pipelines.formats import jsonl
from seqpack.pipelines.formats.inputs import ReadOptions, read_corpus
from seqpack.pipelines.formats.parquet import ParquetTokens
from seqpack.pipelines.formats.paths import check_distinct
from seqpack.pipelines.formats.text import load_tokenizer
from seqpack.pipelines.offline import PackJob, WriteOptions, job, pack
from seqpack.pipelines.offline.outdir import check_dir
from seqpack.pipelines.offline.record import check_overlength
from tests.helpers.files import write_arrayrecord, write_jsonl, write_parquet, write_tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEQS = [[1, 2, 3], [4, 5], [6]]
CONFIG = PackConfig(8, max_segments=4)
# A parameter as a message names it: name=, name=value, name['key']=.
MENTION = re.compile(r"(?<![\w./=-])([a-z_][\w.]*)(?:\[[^\]]*\])?=('[^']*'|True)?")
FLAG = re.compile(r"(?<![\w-])--[a-z]")


def _job(tmp_path, **kwargs):
    return PackJob([write_jsonl(tmp_path / "a.jsonl", SEQS)], tmp_path / "out", CONFIG, **kwargs)


def _text_parquet(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"tokens": pa.array(["the cat"])}), path)
    return str(path)


def _resume_another_run(tmp_path):
    pack(_job(tmp_path, workers=1))
    pack(PackJob(_job(tmp_path).inputs, tmp_path / "out", PackConfig(16, max_segments=4),
                 existing="resume", workers=1))


def _no_tokenizers(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    load_tokenizer(str(tmp_path / "tok.json"))


def _raise(e):
    raise e


def _read(write, name: str, *, tokenizer: bool = False, **options):
    """What reads SEQS written by `write` to `name` with ReadOptions(**options) (`tokenizer`:
    a tokenizer.json's)."""

    def read(monkeypatch, tmp_path):
        tok = {"tokenizer": write_tokenizer(tmp_path / "tok.json")} if tokenizer else {}
        read_corpus([write(tmp_path / name, SEQS)], ReadOptions(**options, **tok))

    return read


# case -> (what raises the library's error, given monkeypatch and tmp_path; what the CLI reads)
CASES = {
    "pad_of_no_column": (lambda mp, t: _job(t, pads={"labels": -100}),
                         ["--pad labels=...: 'labels' is not an extra column (--column [])"]),
    "column_taken": (lambda mp, t: _job(t, read_options=ReadOptions(
        extra_columns=("tokens_segment_ids",))),
        ["--column ['tokens_segment_ids']: the rows already have a key", "--feature tokens)",
         "pass another --feature"]),
    "pad_not_int": (lambda mp, t: _job(t, read_options=ReadOptions(extra_columns=("labels",)),
                                      pads={"labels": "x"}),
                    ["--pad labels=x must be an integer"]),
    "bad_role": (lambda mp, t: _job(t, read_options=ReadOptions(extra_columns=("labels",)),
                                   roles={"labels": "loss"}),
                 ["--role labels=loss: the role must be one of"]),
    "role_of_no_column": (lambda mp, t: _job(t, read_options=ReadOptions(
        extra_columns=("labels",)), roles={"mask": "mask"}),
        ["--role mask=...: 'mask' is not an extra column (--column ['labels'])"]),
    "row_memory": (lambda mp, t: _memory_row(mp, t),
                   ["--seq-len 100000000, --max-segments 64: one packed row needs 1.5 GiB",
                    "pick a smaller --seq-len or --max-segments"]),
    "shard_memory": (lambda mp, t: _memory_shard(mp, t),
                     ["--shard-rows 1024 x (--seq-len 1000000, --max-segments 64) x 2 "
                      "worker(s) needs 30.5 GiB",
                      "pass --shard-rows 33 or fewer (or fewer --workers)"]),
    "resume_and_overwrite": (lambda mp, t: check_dir(str(t), overwrite=True, resume=True),
                             ["pass either --overwrite or --resume, not both"]),
    "not_empty": (lambda mp, t: (write_jsonl(t / "x.jsonl", SEQS),
                                 check_dir(str(t), overwrite=False, resume=False)),
                  ["exists and is not empty; pass --overwrite to replace it or --resume to "
                   "finish an interrupted run"]),
    "resume_another_run": (lambda mp, t: _resume_another_run(t), ["; rerun with --overwrite"]),
    "over_length": (lambda mp, t: check_overlength(["a.jsonl"], [(2, 100, 2)], CONFIG),
                    ["pass --overflow truncate, split or drop to keep them, or a larger "
                     "--seq-len"]),
    "file_too_large": (lambda mp, t: _raise(RunFailed.of(OSError(errno.EFBIG, "File too large"),
                                                         "rows-0.arrayrecord", "cannot write")),
                       ["or pass a smaller --shard-rows"]),
    "given_twice": (lambda mp, t: check_distinct([write_jsonl(t / "a.jsonl", SEQS)] * 2),
                    ["drop the repeat, or pass --allow-duplicates to read it again"]),
    "jsonl_field_missing": (_read(write_jsonl, "a.jsonl", column="ids"),
                            ["name the token list with --column or --field"]),
    "jsonl_text_without_tokenizer": (
        lambda mp, t: jsonl.tokens("the cat", "tokens", "a.jsonl:1", np.dtype(np.int32)),
        ["; text is tokenized by seqpack pack with --tokenizer (a Grain source: map it"]),
    "jsonl_ids_with_tokenizer": (
        _read(write_jsonl, "a.jsonl", tokenizer=True),
        ["holds token ids, not text; --tokenizer tokenizes a text field (drop --tokenizer for "
         "token ids, or point --column at the text)"]),
    "jsonl_columns_with_tokenizer": (
        lambda mp, t: list(jsonl.read_chunks(write_jsonl(t / "a.jsonl", SEQS), "tokens",
                                             object(), aligned_columns=("labels",))),
        ["extra columns cannot be read with --tokenizer (the"]),
    "columns_with_tokenizer": (lambda mp, t: ReadOptions(extra_columns=("a",), tokenizer="t"),
                               ["cannot be read with --tokenizer (tokenized lengths"]),
    "columns_of_text": (lambda mp, t: ReadOptions(extra_columns=("a",), input_format="text"),
                        ["--input-format text has one column"]),
    "bytes_with_tokenizer": (lambda mp, t: ReadOptions(input_format="bytes", tokenizer="t"),
                             ["--input-format bytes packs raw bytes; drop --tokenizer, or read"]),
    "not_utf8": (lambda mp, t: (t.joinpath("a.txt").write_bytes(b"\xff\xfe"),
                                read_corpus([str(t / "a.txt")], ReadOptions())),
                 ["; pass --input-format bytes to pack its raw bytes"]),
    "unknown_format": (lambda mp, t: (t.joinpath("blob").write_bytes(bytes(range(256))),
                                      read_corpus([str(t / "blob")], ReadOptions())),
                       ["pass --input-format (jsonl, parquet"]),
    "parquet_column_missing": (_read(write_parquet, "a.parquet", column="ids"),
                               ["pass --column naming the token list"]),
    "parquet_extra_column_missing": (_read(write_parquet, "a.parquet", extra_columns=("labels",)),
                                     ["pass --column naming columns the file holds"]),
    "parquet_text_without_tokenizer": (
        lambda mp, t: read_corpus([_text_parquet(t)], ReadOptions()),
        ["text: name the token ids with --column, or tokenize the text (seqpack pack: "
         "--tokenizer tokenizer.json; a Grain source: map it"]),
    "parquet_ids_with_tokenizer": (
        _read(write_parquet, "a.parquet", tokenizer=True),
        ["not text; --tokenizer tokenizes a text column (drop --tokenizer for token ids, or "
         "point --column at the text)"]),
    "parquet_columns_with_tokenizer": (
        lambda mp, t: ParquetTokens(write_parquet(t / "a.parquet", SEQS), "tokens",
                                    tokenizer=object(), aligned_columns=("labels",)),
        ["extra columns cannot be read with --tokenizer (the"]),
    "arrayrecord_array_missing": (_read(write_arrayrecord, "a.arrayrecord", column="ids"),
                                  ["pass --column naming arrays the records hold"]),
    "arrayrecord_with_tokenizer": (
        _read(write_arrayrecord, "a.arrayrecord", tokenizer=True),
        ["ArrayRecord records hold token ids; --tokenizer is for text"]),
    "tokenizers_missing": (_no_tokenizers, ["--tokenizer needs tokenizers: pip install"]),
}


def _memory_row(monkeypatch, tmp_path):
    monkeypatch.setattr(job, "available_memory", lambda: 2**30)
    PackJob(_job(tmp_path).inputs, tmp_path / "out", PackConfig(100_000_000)).check_memory()


def _memory_shard(monkeypatch, tmp_path):
    monkeypatch.setattr(job, "available_memory", lambda: 2**30)
    PackJob(_job(tmp_path).inputs, tmp_path / "out", PackConfig(1_000_000), workers=2,
            write_options=WriteOptions()).check_memory()


@pytest.mark.parametrize("case", sorted(CASES))
def test_library_errors_name_parameters_and_the_cli_its_flags(case, monkeypatch, tmp_path):
    make, cli_words = CASES[case]
    with pytest.raises((ValueError, ImportError, OSError)) as info:
        make(monkeypatch, tmp_path)
    message = str(info.value)
    assert not FLAG.search(message), message  # no CLI flag in the library's words
    mentions = MENTION.findall(message)
    assert mentions, message  # it names the parameter to change
    for name, value in mentions:  # the CLI's table covers each
        assert name in FLAGS or f"{name}={value}" in FLAGS, (name, value, message)
    cli = to_flags(message)
    for words in cli_words:
        assert words in cli, cli
    assert not [m for m in MENTION.findall(cli) if m[0] in FLAGS], cli
    assert to_flags(cli) == cli


@pytest.mark.parametrize("message, want", [
    ("shard_rows=33 or fewer", "--shard-rows 33 or fewer"),
    ("pick a smaller seq_len=", "pick a smaller --seq-len"),
    ("(or fewer workers=)", "(or fewer --workers)"),
    ("feature='not an id' must be", "--feature 'not an id' must be"),
    ("pads['labels']=-100", "--pad labels=-100"),
    ("roles['my labels']='x'", "--role 'my labels'=x"),
    ("pass overflow='truncate', 'split' or 'drop', or", "pass --overflow truncate, split or "
                                                        "drop, or"),
    ("pass existing='resume', or existing='overwrite'", "pass --resume, or --overwrite"),
    ("beam_options= needs runner='beam'", "--beam-option needs --runner beam"),
    # Not parameters: other names, paths, parts of other words, Beam's own options, flags.
    ("gs://b/seq_len=64/a.parquet: no such object", "gs://b/seq_len=64/a.parquet: no such object"),
    ("direct_num_workers=8 max_workers=2", "direct_num_workers=8 max_workers=2"),
    ("--beam-option runner=DaskRunner: refused", "--beam-option runner=DaskRunner: refused"),
    ("tokens[1]=2.5 is not a token id; dtype=float32", "tokens[1]=2.5 is not a token id; "
                                                      "dtype=float32"),
    ("pass --shard-rows 33", "pass --shard-rows 33"),
])
def test_to_flags(message, want):
    assert to_flags(message) == want


def _error_strings(path: pathlib.Path):
    """(line, text) of every string constant outside docstrings, f-string parts joined."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr)}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            yield node.lineno, "".join(v.value for v in node.values
                                       if isinstance(v, ast.Constant))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings:
            yield node.lineno, node.value


def test_no_library_message_names_a_flag():
    """Flags only where a message names a whole command (`seqpack pack ... --resume`)."""
    found = []
    for path in sorted((ROOT / "pipelines").rglob("*.py")) + sorted((ROOT / "packer").rglob(
            "*.py")):
        name = str(path.relative_to(ROOT))
        if name in ("pipelines/console.py", "pipelines/options.py"):  # the command line's own
            continue
        for line, text in _error_strings(path):
            if FLAG.search(re.sub(r"`[^`]*`", "", text)):
                found.append(f"{name}:{line}: {text!r}")
    assert not found, "\n".join(found)


def test_the_table_names_real_flags():
    from seqpack import cli

    flags = {opt for command in cli.seqpack.commands.values() for p in command.params
             for opt in p.opts}
    for flag in FLAGS.values():
        assert flag.split()[0] in flags, flag
