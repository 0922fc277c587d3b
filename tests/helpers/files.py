"""Input files for the CLI tests: JSONL, Parquet, ArrayRecord, Megatron .bin/.idx, text and a
tiny tokenizer.json."""

from __future__ import annotations

import json
import os
import pathlib
import struct
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def random_seqs(n: int, *, max_len: int = 40, seed: int = 0, vocab: int = 1000) -> list[list[int]]:
    """n examples of 0..max_len token ids (some empty, token 0 included)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_len + 1, n)
    return [rng.integers(0, vocab, m).tolist() for m in lengths]


def write_jsonl(path: os.PathLike, seqs, *, field: str = "tokens") -> str:
    with open(path, "w") as f:
        for i, s in enumerate(seqs):
            f.write(json.dumps({field: s, "id": i}) + "\n")
    return str(path)


def write_parquet(path: os.PathLike, seqs, *, column: str = "tokens", value_type=None) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pa.list_(value_type or pa.int32())
    pq.write_table(pa.table({column: pa.array(seqs, type=t), "id": list(range(len(seqs)))}),
                   path, row_group_size=max(1, len(seqs) // 3))
    return str(path)


def write_arrayrecord(path: os.PathLike, seqs, *, column: str = "tokens") -> str:
    from array_record.python.array_record_module import ArrayRecordWriter

    from seqpack.pipelines.formats.records import encode_row

    w = ArrayRecordWriter(str(path), "group_size:1")
    for i, s in enumerate(seqs):
        w.write(encode_row({column: np.asarray(s, np.int32), "id": np.int64(i)}))
    w.close()
    return str(path)


def write_tokenizer(path: os.PathLike, *, pad_to: int | None = None) -> str:
    """A word-level tokenizer.json: whitespace split, 8 words + [UNK] (+ [PAD] = 9).

    pad_to: saved with padding and truncation to this length switched on, as tokenizers saved
    for inference often are.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "the", "cat", "sat", "on", "a", "mat", "dog", "ran", "[PAD]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if pad_to:
        tok.enable_padding(pad_id=9, pad_token="[PAD]", length=pad_to)
        tok.enable_truncation(max_length=pad_to)
    tok.save(str(path))
    return str(path)


def run_cli(*args, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m seqpack.cli ARGS` as a real subprocess from the repository root."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "seqpack.cli", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, env=full_env, timeout=timeout)


def three_formats(directory: pathlib.Path) -> list[str]:
    """Three inputs of 360 examples in all, up to 90 tokens each: a.jsonl (120), b.parquet
    (150), c.arrayrecord (90); the runners' byte-equality corpus."""
    return [
        write_jsonl(directory / "a.jsonl", random_seqs(120, max_len=90, seed=1)),
        write_parquet(directory / "b.parquet", random_seqs(150, max_len=90, seed=2)),
        write_arrayrecord(directory / "c.arrayrecord", random_seqs(90, max_len=90, seed=3)),
    ]


def bad_record_is_one_error_line(directory: pathlib.Path, *runner: str) -> None:
    """`seqpack pack` with `runner`'s flags on a good input and one whose third record holds a
    string: exit 2, one `Error:` line naming the file and record, no output directory left."""
    good = write_jsonl(directory / "good.jsonl", random_seqs(30, seed=1))
    bad = directory / "bad.jsonl"
    bad.write_text('{"tokens": [1, 2]}\n{"tokens": [3]}\n{"tokens": [4, "x"]}\n')
    out = directory / "out"
    result = run_cli("pack", good, bad, "-o", out, *runner)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "bad.jsonl:3: tokens[1]='x' is not a non-negative integer" in result.stderr
    assert not out.exists()


def dir_bytes(path: os.PathLike) -> dict[str, bytes]:
    """name -> bytes of every file in a directory."""
    return {n: pathlib.Path(path, n).read_bytes() for n in sorted(os.listdir(path))}


def write_manifest(directory: os.PathLike, shards: list[str], shard_num_rows: list[int], *,
                   seq_len: int, max_segments: int = 64, feature: str = "tokens") -> None:
    """A complete manifest.json for hand-made shards (what `seqpack pack` would write)."""
    from seqpack.packer import PackConfig
    from seqpack.pipelines.formats.manifest import Manifest, file_digest
    from seqpack.pipelines.formats.manifest import write_manifest as write

    config = PackConfig(seq_len, max_segments=max_segments, feature=feature)
    digests = [file_digest(os.path.join(directory, s)) if os.path.isfile(
        os.path.join(directory, s)) else (0, "") for s in shards]
    write(str(directory), Manifest(
        config=config.to_dict(), inputs={}, writer_options="group_size:1",
        stored_keys=list(config.keys().roles().values()), shard_rows=max(shard_num_rows),
        num_rows=sum(shard_num_rows), shards=shards, shard_num_rows=shard_num_rows, stats={},
        example_length_histogram={}, shard_bytes=[b for b, _ in digests],
        shard_sha256=[h for _, h in digests]))


def invoke(*args, ok: bool = True):
    """`seqpack ARGS` in this process (click's CliRunner); ok=True asserts exit code 0."""
    from click.testing import CliRunner

    from seqpack import cli

    result = CliRunner().invoke(cli.seqpack, [str(a) for a in args])
    if ok:
        assert result.exit_code == 0, (result.output, result.exception)
    return result


def write_megatron(prefix, seqs, dtype=np.uint16) -> str:
    """A Megatron-LM indexed dataset as its `_IndexWriter` writes one (one document a
    sequence); returns the .bin's path."""
    dtype = np.dtype(dtype)
    code = {np.dtype(np.uint8): 1, np.dtype(np.int32): 4, np.dtype(np.int64): 5,
            np.dtype(np.uint16): 8, np.dtype(np.float32): 7}[dtype]
    sizes = np.array([len(s) for s in seqs], np.int32)
    pointers = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64) * dtype.itemsize
    docs = np.arange(len(seqs) + 1, dtype=np.int64)
    with open(f"{prefix}.bin", "wb") as f:
        for s in seqs:
            f.write(np.asarray(s, dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(seqs)) + struct.pack("<Q", docs.size))
        f.write(sizes.tobytes() + pointers.tobytes() + docs.tobytes())
    return f"{prefix}.bin"
