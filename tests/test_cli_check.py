"""`seqpack stats`, `verify` and `inspect` through CliRunner, including tampered outputs."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from seqpack.packer import PackConfig, plan, stats
from seqpack.packer.order import CostModel
from seqpack.pipelines.formats.manifest import signed
from seqpack.pipelines.formats.records import decode_row, encode_row
from seqpack.pipelines.offline.verify import verify
from tests.helpers.files import invoke, random_seqs, write_jsonl, write_parquet

SEQS = random_seqs(400, max_len=60, seed=2) + [list(range(150))]  # one over-length example


@pytest.fixture
def packed(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", SEQS)
    out = tmp_path / "out"
    invoke("pack", src, "-o", out, "--seq-len", 64, "--max-segments", 8, "--overflow", "split",
           "--shard-rows", 20)
    return src, out


def rewrite_shard(out, name, edit):
    """Rewrites shard `name` with edit(rows) -> rows (lists of decoded, writable rows)."""
    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

    reader = ArrayRecordReader(str(out / name))
    rows = [{k: v.copy() for k, v in decode_row(raw).items()} for raw in reader.read_all()]
    reader.close()
    writer = ArrayRecordWriter(str(out / name), "group_size:1,uncompressed")
    for row in edit(rows):
        writer.write(encode_row(row))
    writer.close()


def manifest_of(out) -> dict:
    return json.loads((out / "manifest.json").read_text())


# -- stats ---------------------------------------------------------------------------------------


def test_stats_of_a_packed_dir(packed, tmp_path):
    _, out = packed
    m = manifest_of(out)
    text = invoke("stats", out, "--batch-size", 7).stdout
    assert "best_fit_decreasing" in text and f"{m['stats']['efficiency']:.2%}" in text
    # a step is a full batch (the training pipeline drops a last, short one): the table and
    # the JSON agree, and the rows left over are said
    assert f"{m['num_rows']:,}" in text
    assert re.search(rf"steps / epoch \(batch 7\) +{m['num_rows'] // 7:,}\n", text)
    assert re.search(rf"rows left over \(not a step\) +{m['num_rows'] % 7:,}\n", text)
    s = json.loads(invoke("stats", out, "--json", "--batch-size", 7).stdout)
    s = s["summary"]["best_fit_decreasing"]
    assert (s["steps_per_epoch"], s["rows_left_per_epoch"]) == divmod(m["num_rows"], 7)
    data = json.loads(invoke("stats", out, "--json").stdout)
    assert data["stats"] == {"best_fit_decreasing": m["stats"]}
    s = data["summary"]["best_fit_decreasing"]
    assert s["steps_per_epoch"] is None  # no batch size given, none recorded: no steps
    assert "steps / epoch" not in invoke("stats", out).stdout
    assert s["split_examples"] == 1 and s["rows"] == m["num_rows"]
    png = tmp_path / "stats.png"
    invoke("stats", out, "--plot", png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    refused = invoke("stats", out, "--cost-model", "tokens", "--seq-len", 64, ok=False)
    assert refused.exit_code == 2 and "--seq-len, --cost-model apply to a dry run" in \
        refused.output, refused.output  # they would be ignored: the manifest decides
    refused = invoke("stats", out, "--allow-duplicates", ok=False)  # before: ignored
    assert refused.exit_code == 2 and "--allow-duplicates applies to a dry run" in \
        refused.output, refused.output


def test_stats_dry_run_per_strategy_matches_the_planner(tmp_path):
    src = write_parquet(tmp_path / "a.parquet", SEQS)
    data = json.loads(invoke("stats", src, "--seq-len", 64, "--max-segments", 8, "--overflow",
                             "truncate", "--batch-size", 4, "--json").stdout)
    assert list(data["stats"]) == ["first_fit", "best_fit", "best_fit_decreasing", "concat_split"]
    lengths = np.array([len(s) for s in SEQS])
    for name, got in data["stats"].items():
        cfg = PackConfig(64, max_segments=8, strategy=name, overflow="truncate")
        assert got == stats(plan(lengths, cfg), seq_len=64, max_segments=8,
                            cost=CostModel()).to_dict()
        assert data["summary"][name]["steps_per_epoch"] == got["num_rows"] // 4
    assert data["summary"]["best_fit_decreasing"]["truncated_tokens"] == 150 - 64
    assert sum(data["example_length_histogram"]["counts"]) == len(SEQS)
    text = invoke("stats", src, "--seq-len", 64, "--overflow", "drop", "--strategy", "best_fit",
                  "--strategy", "first_fit").stdout
    header = text.splitlines()[1].split()
    assert header == ["best_fit", "first_fit"] and "dry run" in text
    assert "dropped tokens" in text and "150" in text


def test_stats_dry_run_in_workers_gives_the_figures_of_one(tmp_path, monkeypatch):
    """--workers: the inputs are scanned and every strategy's blocks planned in the worker
    processes (here from one example on); the same JSON as one process."""
    from seqpack.pipelines.offline import report
    from seqpack.pipelines.offline.runners import read
    from seqpack.pipelines.offline.runners import workers as workers_mod

    srcs = [write_parquet(tmp_path / "a.parquet", SEQS[:150]),
            write_jsonl(tmp_path / "b.jsonl", SEQS[150:300]), write_jsonl(tmp_path / "c.jsonl",
                                                                         SEQS[300:])]
    seen = []
    real = workers_mod.Workers.map

    def spy(self, fn, calls, count, *, what="working", in_flight=None):
        seen.append((what, count, self.n))
        return real(self, fn, calls, count, what=what, in_flight=in_flight)

    monkeypatch.setattr(workers_mod.Workers, "map", spy)
    monkeypatch.setattr(report, "_PARALLEL_PLAN", 1)
    monkeypatch.setattr(read, "_PARALLEL_BYTES", 1)
    args = ["stats", *srcs, "--seq-len", 64, "--max-segments", 8, "--overflow", "split",
            "--block-size", 97, "--json"]
    one = json.loads(invoke(*args, "--workers", 1).stdout)
    two = json.loads(invoke(*args, "--workers", 2).stdout)
    assert two == one
    blocks = -(-len(SEQS) // 97)
    assert ("reading the inputs", 3, 2) in seen
    assert ("planning blocks", 4 * blocks, 2) in seen  # four strategies' blocks, one map
    assert "planning blocks" not in [s[0] for s in seen if s[2] == 1]
    lengths = np.array([len(s) for s in SEQS])
    cfg = PackConfig(64, max_segments=8, overflow="split")
    assert one["stats"]["best_fit_decreasing"] == stats(
        plan(lengths, cfg, block_size=97), seq_len=64, max_segments=8, cost=CostModel()).to_dict()


def test_stats_dry_run_of_small_inputs_starts_no_worker(tmp_path, monkeypatch):
    """Inputs of fewer bytes than `read._PARALLEL_BYTES` in all are scanned in this process
    (starting the workers would cost more than the scan), and a small plan is planned here too:
    no process starts, the figures are those of one process."""
    from seqpack.pipelines.offline.runners import workers as workers_mod

    srcs = [write_jsonl(tmp_path / "a.jsonl", SEQS[:150]),
            write_jsonl(tmp_path / "b.jsonl", SEQS[150:])]
    args = ["stats", *srcs, "--seq-len", 64, "--max-segments", 8, "--overflow", "split",
            "--json"]
    one = json.loads(invoke(*args, "--workers", 1).stdout)

    def refuse(self):
        raise AssertionError("a worker process started")

    monkeypatch.setattr(workers_mod.Workers, "_start", refuse)
    assert json.loads(invoke(*args, "--workers", 4).stdout) == one


def test_small_inputs_asks_for_sizes_only_until_they_pass_the_threshold(tmp_path, monkeypatch):
    """`read._small_inputs` asks for one size at a time and stops once the sum passes
    `_PARALLEL_BYTES`; over `_PARALLEL_FILES` inputs it asks for none (each is a request on
    object storage)."""
    from seqpack.pipelines import storage
    from seqpack.pipelines.offline.runners import read

    paths = [str(write_jsonl(tmp_path / f"{k}.jsonl", SEQS[:20])) for k in range(4)]
    asked = []
    real = storage.size
    monkeypatch.setattr(storage, "size", lambda p: asked.append(p) or real(p))
    assert read._small_inputs(paths) and asked == paths
    asked.clear()
    monkeypatch.setattr(read, "_PARALLEL_BYTES", real(paths[0]) + 1)  # the second passes it
    assert not read._small_inputs(paths) and asked == paths[:2]
    asked.clear()
    monkeypatch.setattr(read, "_PARALLEL_FILES", 3)
    assert not read._small_inputs(paths) and asked == []


def test_stats_dry_run_names_the_file_of_an_over_length_example(tmp_path):
    """overflow "error": the error of `seqpack pack` (file and record), not the planner's
    index into all the inputs; concat_split alone cuts examples and needs no overflow."""
    a = write_jsonl(tmp_path / "a.jsonl", [[1] * 10] * 5)
    b = write_jsonl(tmp_path / "b.jsonl", [[1] * 10, [2] * 70, [3] * 80])
    for workers in (1, 2):
        result = invoke("stats", a, b, "--seq-len", 64, "--workers", workers, ok=False)
        assert result.exit_code == 2
        assert "b.jsonl: example 1 (counting from 0) has 70 tokens" in result.output
        assert "2 over-length example(s)" in result.output
    text = invoke("stats", a, b, "--seq-len", 64, "--strategy", "concat_split").stdout
    assert "concat_split" in text


def test_stats_refuses_an_overflow_for_concat_split_alone_as_pack_does(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", SEQS)
    for cmd in (("pack", src, "-o", tmp_path / "o"), ("stats", src)):  # before: stats took it
        result = invoke(*cmd, "--strategy", "concat_split", "--overflow", "truncate", ok=False)
        assert result.exit_code == 2 and "--overflow truncate does not apply to --strategy " \
            "concat_split" in result.output, result.output


def test_stats_dry_run_plot(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", SEQS)
    png = tmp_path / "p.png"
    assert "plots written" in invoke("stats", src, "--overflow", "split", "--plot", png).stdout
    assert png.stat().st_size > 1000
    # A missing folder is made (before: a bare ENOENT after the work, the table lost).
    deep = tmp_path / "a" / "b" / "p.png"
    assert "rows over bound" in invoke("stats", src, "--overflow", "split", "--plot", deep).stdout
    assert deep.stat().st_size > 1000
    # A name matplotlib cannot write is refused before the work (before: its traceback).
    result = invoke("stats", src, "--overflow", "split", "--plot", tmp_path / "p.txt", ok=False)
    assert result.exit_code == 2 and "name a .png, .pdf or .svg file" in result.output


# -- verify --------------------------------------------------------------------------------------


def test_verify_ok_and_json(packed):
    src, out = packed
    assert invoke("verify", out, src).stdout.startswith("OK:")
    report = json.loads(invoke("verify", out, "--json").stdout)  # inputs from the manifest
    assert report["ok"] and report["tokens_checked"] == sum(map(len, SEQS))
    assert report["num_examples"] == len(SEQS) and report["violations"] == []


def test_verify_finds_a_changed_token(packed):
    src, out = packed
    name = manifest_of(out)["shards"][1]

    def edit(rows):
        rows[3]["tokens"][2] += 1
        return rows

    rewrite_shard(out, name, edit)
    result = invoke("verify", out, src, ok=False)
    assert result.exit_code == 1 and "FAILED" in result.stderr
    assert f"{name} row 3 slot 0 position 2: token" in result.stdout


def test_verify_finds_a_missing_row(packed):
    src, out = packed
    m = manifest_of(out)
    rewrite_shard(out, m["shards"][0], lambda rows: rows[1:])
    m["shard_num_rows"][0] -= 1
    (out / "manifest.json").write_text(json.dumps(signed(m)))
    result = invoke("verify", out, src, ok=False)
    assert result.exit_code == 1
    assert "tokens are not in any row" in result.stdout
    assert "num_rows" in result.stdout


def test_verify_finds_a_duplicated_segment(packed):
    src, out = packed
    m = manifest_of(out)
    rewrite_shard(out, m["shards"][2], lambda rows: [rows[0], *rows[:-1]])
    result = invoke("verify", out, src, ok=False)
    assert result.exit_code == 1 and "): tokens duplicated" in result.stdout, result.stdout


def test_verify_finds_broken_contract_and_counters(packed):
    src, out = packed
    m = manifest_of(out)

    def edit(rows):
        rows[0]["tokens_segment_ids"][0] = 5
        return rows

    rewrite_shard(out, m["shards"][0], edit)
    m["stats"]["counters"]["split_examples"] = 0
    (out / "manifest.json").write_text(json.dumps(signed(m)))
    out_text = invoke("verify", out, src, ok=False).stdout
    assert "violates the row contract" in out_text and "row 0 position 0" in out_text
    assert "manifest counter split_examples=0 but the rows give 1" in out_text


def test_verify_finds_a_changed_input(packed, tmp_path):
    _, out = packed
    seqs = [list(s) for s in SEQS]
    for k in (5, 100, 200, 300):
        seqs[k][0] = (seqs[k][0] + 1) % 1000 if seqs[k] else 1
    other = write_jsonl(tmp_path / "b.jsonl", seqs)
    result = invoke("verify", out, other, "--max-violations", 2, ok=False)
    assert result.exit_code == 1 and "differs from the packed input" in result.stdout
    assert result.stdout.count("\n  ") <= 2
    found = int(re.search(r"FAILED: (\d+) violation\(s\) found, the first 2 listed",
                          result.stderr)[1])
    # Before: "FAILED: 2 violation(s) (first 2 listed)", the count capped at the limit.
    assert found == len(verify(str(out), [str(other)], max_violations=100).violations) > 2


def test_verify_wrong_number_of_inputs(packed):
    src, out = packed
    result = invoke("verify", out, src, src, ok=False)
    assert result.exit_code == 2 and "the manifest lists 1" in result.stderr


# -- inspect -------------------------------------------------------------------------------------


def test_inspect_row_column_aligned(packed):
    _, out = packed
    m = manifest_of(out)
    text = invoke("inspect", out, "--row", 21, "--width", 10).stdout
    from seqpack.pipelines.offline.shards import read_shard

    row = {k: v[1] for k, v in read_shard(str(out), m["shards"][1]).items()}  # 20 rows per shard
    assert text.startswith(f"row 21 of {m['num_rows']:,} ({m['shards'][1]} record 1)")
    lines = text.splitlines()
    tok_line = next(line for line in lines if line.startswith("tokens "))
    assert tok_line.split()[1:] == [str(t) for t in row["tokens"][:10]]
    pos_line = next(line for line in lines if line.startswith("tokens_positions"))
    assert len(pos_line) == len(tok_line)  # columns aligned
    src_line = next(line for line in lines if line.startswith("segment_source_index"))
    used = int((row["tokens_segment_lengths"] > 0).sum())
    assert src_line.split()[1:] == [str(s) for s in row["segment_source_index"][:used]]
    assert sum(line.startswith("tokens_segment_ids") for line in lines) == -(-64 // 10)
    short = invoke("inspect", out, "--row", 21, "--start", 60, "--count", 100).stdout
    assert sum(line.startswith("tokens ") for line in short.splitlines()) == 1
    data = json.loads(invoke("inspect", out, "--row", -1, "--json").stdout)
    last = read_shard(str(out), m["shards"][-1])
    assert data["tokens"] == last["tokens"][-1].tolist()


def test_inspect_out_of_range(packed):
    _, out = packed
    result = invoke("inspect", out, "--row", 10**6, ok=False)
    assert result.exit_code == 2 and "out of range" in result.stderr
    for extra in ((), ("--json",)):  # before: exit 0, no positions shown
        result = invoke("inspect", out, "--row", 0, "--start", 64, *extra, ok=False)
        assert result.exit_code == 2 and "--start 64 is past the row's 64 positions" in \
            result.stderr, result.output


def test_a_tokenizer_reads_text_files_beside_jsonl_text(tmp_path):
    """With --tokenizer every input gives the tokenizer's ids: a .txt beside JSONL text is one
    corpus (without one, its bytes beside token ids are refused: tests/test_first_hour.py)."""
    from tests.helpers.files import write_tokenizer

    (tmp_path / "a.txt").write_text("the cat sat\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "the dog ran on a mat"}) + "\n")
    tok = write_tokenizer(tmp_path / "tok.json")
    out = tmp_path / "out"
    invoke("pack", tmp_path / "a.txt", tmp_path / "b.jsonl", "-o", out, "--seq-len", 16,
           "--tokenizer", tok, "--field", "text")
    assert invoke("verify", out).stdout.startswith("OK:")
    assert json.loads((out / "manifest.json").read_text())["stats"]["real_tokens"] == 3 + 6


def test_verify_notices_a_changed_tokenizer(tmp_path):
    from tests.helpers.files import write_tokenizer

    text = tmp_path / "a.txt"
    text.write_text("the cat sat\nthe dog ran on a mat\n")
    tok = tmp_path / "tok.json"
    write_tokenizer(tok)
    out = tmp_path / "out"
    invoke("pack", text, "-o", out, "--seq-len", 8, "--tokenizer", tok, "--text-unit", "line")
    assert invoke("verify", out).stdout.startswith("OK:")
    spec = json.loads(tok.read_text())
    vocab = spec["model"]["vocab"]
    vocab["cat"], vocab["dog"] = vocab["dog"], vocab["cat"]
    tok.write_text(json.dumps(spec))
    result = invoke("verify", out, ok=False)
    assert result.exit_code == 1 and "tokenizer" in result.stdout and "changed" in result.stdout
    assert "tokens 2 != 7" in result.stdout  # the row holds "cat" = 2, which now encodes as 7


def test_the_lower_bound_counts_the_segment_alignment(tmp_path):
    """Each segment starts at a multiple of the alignment: the rows hold the lengths rounded
    up, which no plan avoids (before: the bound counted the tokens alone, and a plan at the
    optimum read 20% over it)."""
    seqs = random_seqs(300, max_len=90, seed=3)
    src = write_jsonl(tmp_path / "a.jsonl", seqs)
    args = ("--seq-len", 256, "--segment-alignment", 32, "--max-segments", 64)
    want = -(-sum(-(-len(s) // 32) * 32 for s in seqs) // 256)
    dry = json.loads(invoke("stats", src, *args, "--json").output)
    assert dry["stats"]["best_fit_decreasing"]["lower_bound_rows"] == want
    out = tmp_path / "out"
    invoke("pack", src, "-o", out, *args)
    m = manifest_of(out)
    assert m["stats"]["lower_bound_rows"] == want
    assert invoke("verify", out).exit_code == 0
    # A manifest written before, with the bound of the tokens alone, still verifies.
    m["stats"]["lower_bound_rows"] = -(-sum(map(len, seqs)) // 256)
    (out / "manifest.json").write_text(json.dumps(signed(m)))
    assert invoke("verify", out).stdout.startswith("OK:")
