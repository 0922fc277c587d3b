"""Bad input: one `Error:` line on stderr naming the problem, exit code 2, no finished output."""

from __future__ import annotations

import functools
import json
import os

import pytest

from seqpack.pipelines.formats.manifest import signed
from tests.helpers import files
from tests.helpers.files import write_arrayrecord, write_jsonl, write_parquet, write_tokenizer

invoke = functools.partial(files.invoke, ok=False)  # these runs are meant to fail

SEQS = [[1, 2, 3], [4, 5], [], [6, 7, 8, 9]]


def assert_bad_input(result, *needles):
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


def _jsonl_lines(tmp_path, bad_line: str) -> str:
    path = tmp_path / "in.jsonl"
    path.write_bytes(('{"tokens": [1, 2]}\n\n{"tokens": [3]}\n' + bad_line + "\n")
                     .encode("utf-8", "surrogateescape"))
    return str(path)


JSONL_CASES = {
    "malformed": ('{"tokens": [1, 2', "in.jsonl:4: not valid JSON"),
    "not_object": ("[1, 2]", "in.jsonl:4: expected a JSON object"),
    "missing_field": ('{"ids": [1]}', "in.jsonl:4: field 'tokens' is missing"),
    "wrong_type": ('{"tokens": "abc"}', "in.jsonl:4: field 'tokens' must be a list"),
    "float_token": ('{"tokens": [1, 2.5]}', "in.jsonl:4: tokens[1]=2.5 is not"),
    "negative_token": ('{"tokens": [1, -3]}', "in.jsonl:4: tokens[1]=-3 is not"),
    "null_field": ('{"tokens": null}', "in.jsonl:4: field 'tokens' must be a list"),
    # pyarrow's reader takes these as two records; a JSON Lines line holds one object
    "two_objects": ('{"tokens": [1]}{"tokens": [5]}', "in.jsonl:4: not valid JSON"),
    "lone_cr": ('{"tokens": [1]}\r{"tokens": [5]}', "in.jsonl:4: not valid JSON"),
    "latin1": ('{"tokens": [1], "note": "caf\udce9"}', "in.jsonl:4: not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(JSONL_CASES))
def test_bad_jsonl_line_names_file_and_line(tmp_path, case):
    line, needle = JSONL_CASES[case]
    out = tmp_path / "out"
    result = invoke("pack", _jsonl_lines(tmp_path, line), "-o", out)
    assert_bad_input(result, needle)
    assert not (out / "manifest.json").exists()


def test_bad_jsonl_in_stats_dry_run_too(tmp_path):
    assert_bad_input(invoke("stats", _jsonl_lines(tmp_path, "{oops")), "in.jsonl:4")


def test_parquet_wrong_column_type(tmp_path):
    import pyarrow as pa

    float_path = write_parquet(tmp_path / "f.parquet", [[1.0, 2.0]], value_type=pa.float32())
    assert_bad_input(invoke("pack", float_path, "-o", tmp_path / "o"),
                     "f.parquet: column 'tokens' has type list<", "float>")
    assert_bad_input(invoke("pack", float_path, "-o", tmp_path / "o", "--column", "id"),
                     "column 'id' has type int64", "list of integer token ids")


def test_parquet_missing_column_and_nulls(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = write_parquet(tmp_path / "a.parquet", SEQS)
    assert_bad_input(invoke("pack", path, "-o", tmp_path / "o", "--column", "input_ids"),
                     "a.parquet: column 'input_ids' is missing", "--column")
    nulls = tmp_path / "n.parquet"
    pq.write_table(pa.table({"tokens": pa.array([[1], None], pa.list_(pa.int32()))}), nulls)
    assert_bad_input(invoke("pack", nulls, "-o", tmp_path / "o"), "n.parquet record 1", "null")
    neg = write_parquet(tmp_path / "neg.parquet", [[1, -2]])
    assert_bad_input(invoke("pack", neg, "-o", tmp_path / "o"), "neg.parquet", "negative")


def test_not_a_parquet_file(tmp_path):
    path = tmp_path / "x.parquet"
    path.write_bytes(b"definitely not parquet" * 10)
    assert_bad_input(invoke("pack", path, "-o", tmp_path / "o"), "x.parquet: not a readable")


def test_missing_input_file(tmp_path):
    out = tmp_path / "o"
    assert_bad_input(invoke("pack", tmp_path / "nope.jsonl", "-o", out), "nope.jsonl: no such file")
    assert not out.exists()
    assert_bad_input(invoke("stats", tmp_path / "nope.parquet"), "no such file")


def test_unreadable_or_missing_tokenizer(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("the cat\n")
    bad = tmp_path / "tok.json"
    bad.write_text('{"not": "a tokenizer"}')
    assert_bad_input(invoke("pack", text, "-o", tmp_path / "o", "--tokenizer", bad),
                     "tok.json: not a readable tokenizer.json")
    assert_bad_input(invoke("pack", text, "-o", tmp_path / "o", "--tokenizer",
                            tmp_path / "missing.json"), "missing.json: tokenizer file does not")


def test_text_that_is_not_utf8(tmp_path):
    text = tmp_path / "a.txt"
    text.write_bytes(b"the cat\nsat \xff\xfe on\n")
    tok = write_tokenizer(tmp_path / "tok.json")
    assert_bad_input(invoke("pack", text, "-o", tmp_path / "o", "--tokenizer", tok,
                            "--text-unit", "line"), "a.txt:2: not UTF-8")


def test_arrayrecord_input_problems(tmp_path):
    path = write_arrayrecord(tmp_path / "a.arrayrecord", SEQS)
    assert_bad_input(invoke("pack", path, "-o", tmp_path / "o", "--column", "ids"),
                     "a.arrayrecord record 0: array 'ids' is missing")
    garbage = tmp_path / "g.arrayrecord"
    garbage.write_bytes(b"\0" * 100)
    assert_bad_input(invoke("pack", garbage, "-o", tmp_path / "o"), "g.arrayrecord: corrupt")


def test_over_length_with_overflow_error_and_empty_input(tmp_path):
    ok = write_jsonl(tmp_path / "ok.jsonl", [[1, 2]])
    path = write_jsonl(tmp_path / "a.jsonl", [[1], [2], list(range(100)), list(range(70))])
    # In the CLI's words, naming the file and the record (before: "example 2 has length 100
    # > seq_len=64 ...; pass overflow='truncate', 'split' or 'drop'", with no file).
    assert_bad_input(invoke("pack", ok, path, "-o", tmp_path / "o", "--seq-len", 64),
                     f"{path}: example 2 (counting from 0) has 100 tokens, more than seq_len 64 "
                     "(2 over-length example(s) in the inputs); pass --overflow truncate, split "
                     "or drop", "or a larger --seq-len")
    empty = write_jsonl(tmp_path / "e.jsonl", [[], []])
    assert_bad_input(invoke("pack", empty, "-o", tmp_path / "o"), "no tokens")
    assert not os.path.exists(tmp_path / "o" / "manifest.json")


def _packed(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", SEQS * 20)
    out = tmp_path / "out"
    result = invoke("pack", src, "-o", out, "--seq-len", 16, "--shard-rows", 4)
    assert result.exit_code == 0, result.output
    return src, out, json.loads((out / "manifest.json").read_text())


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_corrupt_shard(tmp_path, damage):
    src, out, manifest = _packed(tmp_path)
    shard = out / manifest["shards"][1]
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":  # every chunk damaged
        for i in range(100, len(data) - 100, 97):
            data[i] ^= 0xFF
    else:
        data = bytearray(b"x" * 70000)
    shard.write_bytes(bytes(data))
    result = invoke("verify", out, src, ok=False)  # a violation (exit 1), not bad input
    assert result.exit_code == 1 and f"{manifest['shards'][1]}: size or sha256 differs" \
        in result.stdout and "cannot be decoded" in result.stdout
    assert_bad_input(invoke("inspect", out, "--row", 5), manifest["shards"][1])


def test_shard_missing_or_short(tmp_path):
    src, out, manifest = _packed(tmp_path)
    os.remove(out / manifest["shards"][0])
    result = invoke("verify", out, src, ok=False)  # its rows are lost: a violation (exit 1)
    assert result.exit_code == 1 and f"{manifest['shards'][0]}: missing (" in result.stdout
    manifest["shard_num_rows"][1] += 1
    (out / "manifest.json").write_text(json.dumps(signed(manifest)))
    assert_bad_input(invoke("inspect", out, "--row", 0), manifest["shards"][0],
                     "missing; the manifest lists it")


def test_not_a_packed_dir(tmp_path):
    (tmp_path / "half").mkdir()
    assert_bad_input(invoke("verify", tmp_path / "half"), "manifest.json: missing", "--resume")
    assert_bad_input(invoke("inspect", tmp_path / "nowhere", "--row", 0), "no such directory")
    (tmp_path / "half" / "manifest.json").write_text("{]")
    assert_bad_input(invoke("stats", tmp_path / "half"), "not a seqpack manifest")


def test_usage_errors_exit_2(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", SEQS)
    result = invoke("pack", path)
    assert result.exit_code == 2 and "-o/--output is required" in result.stderr
    result = invoke("pack", path, "-o", tmp_path / "o", "--strategy", "magic")
    assert result.exit_code == 2 and "magic" in result.stderr
    result = invoke("pack", path, "-o", tmp_path / "o", "--seq-len", 10, "--segment-alignment", 3)
    assert_bad_input(result, "--segment-alignment 3 must divide --seq-len 10")


def _failing_pack(monkeypatch, error: BaseException):
    from seqpack.pipelines import offline

    def pack(*args, **kwargs):
        raise error

    monkeypatch.setattr(offline, "pack", pack)


def test_error_policy_maps_exit_codes_in_one_place(tmp_path, monkeypatch):
    from seqpack.pipelines.errors import MissingDependency, UsageError

    src = write_jsonl(tmp_path / "a.jsonl", [[1, 2, 3]])
    args = ("pack", src, "-o", tmp_path / "o")
    _failing_pack(monkeypatch, MissingDependency("x needs pyarrow: pip install 'seqpack[io]'"))
    assert_bad_input(invoke(*args), "pip install 'seqpack[io]'")
    _failing_pack(monkeypatch, UsageError("pass --overwrite"))
    assert_bad_input(invoke(*args), "pass --overwrite")
    _failing_pack(monkeypatch, KeyboardInterrupt())
    result = invoke(*args)
    assert result.exit_code == 130 and "interrupted" in result.stderr
    # A plain ValueError or KeyError from inside is a bug, not bad input: it keeps its traceback.
    for bug in (ValueError("internal invariant"), KeyError("key")):
        _failing_pack(monkeypatch, bug)
        result = invoke(*args)
        assert result.exit_code != 2 and result.exception is bug


def test_bad_option_values_are_usage_errors(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", [[1, 2, 3]])
    assert_bad_input(invoke("pack", src, "-o", tmp_path / "o", "--seq-len", 10,
                            "--segment-alignment", 3), "--segment-alignment 3 must divide")
    assert_bad_input(invoke("pack", src, "-o", tmp_path / "o", "--feature", "not an id"),
                     "--feature 'not an id'")


def test_a_missing_extra_names_the_extra(tmp_path, monkeypatch):
    import sys

    from seqpack.pipelines.errors import MissingDependency, require

    for name in ("pyarrow", "pyarrow.parquet"):  # as if pyarrow were not installed
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MissingDependency, match=r"reading Parquet needs pyarrow: pip install "
                                                r"seqpack \(it is a core dependency; from a "
                                                r"clone: pip install \.\)"):
        require("pyarrow.parquet", "reading Parquet")
    with pytest.raises(MissingDependency, match=r"runner needs apache-beam: pip install "
                                                r"'seqpack\[beam\]' \(from a clone: pip install "
                                                r"'\.\[beam\]'\)"):
        monkeypatch.setitem(sys.modules, "apache_beam", None)
        require("apache_beam", "runner")
    path = tmp_path / "a.parquet"  # never opened: the reader needs pyarrow first
    path.write_bytes(b"PAR1")
    assert_bad_input(invoke("stats", path), "needs pyarrow", "pip install seqpack")


def test_an_interrupted_overwrite_does_not_call_the_earlier_output_its_own(tmp_path):
    import click

    from seqpack import cli
    from seqpack.pipelines import console

    src = write_jsonl(tmp_path / "a.jsonl", [[1, 2, 3], [4, 5]])
    out = tmp_path / "out"
    invoke("pack", src, "-o", out, "--seq-len", 8)
    ctx = click.Context(cli.seqpack)
    args = ["pack", str(src), "-o", str(out), "--seq-len", "8", "--overwrite"]
    # This process wrote it: complete.
    assert console._resume_hint(ctx, args) == f"; the output at {out} is complete"
    earlier = console._STARTED - 60
    os.utime(out / "manifest.json", (earlier, earlier))  # an earlier run's
    # Before: "is complete", for the earlier run's output a Ctrl-C left in place.
    assert console._resume_hint(ctx, args) == (
        f"; the output at {out} is still the earlier run's (this one stopped before replacing "
        "it): run the same command again")
    assert console._resume_hint(ctx, args[:-1]) == f"; the output at {out} is complete"


def test_packing_nothing_is_refused_and_the_dry_run_says_so(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])
    args = ("--seq-len", 4, "--overflow", "drop")
    result = invoke("pack", src, "-o", tmp_path / "out", *args, ok=False)
    # Before: a TypeError traceback (exit 1), an intent left in the output.
    assert result.exit_code == 2, result.output
    assert result.output == ("Error: nothing to pack: --overflow drop dropped all 2 example(s), "
                             "each longer than --seq-len 4; keep them with --overflow split or "
                             "truncate, or pack with longer rows\n")
    assert not (tmp_path / "out").exists()
    dry = invoke("stats", src, *args).output
    assert "warning: overflow drop drops every example" in dry
