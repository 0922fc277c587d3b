"""Input readers: seconds to scan a real corpus (every id checked) per format, one or two columns.

The SFT corpus (``../shared/data/chat_sft_dev.npz``: 30,590 examples, 11.8M tokens, labels -100
on each prompt) is written once as JSONL (``{"input_ids": [...], "labels": [...]}``), the same
gzip-compressed, and Parquet (list<int32> columns). Each case is `formats.inputs.read_lengths`
(what `seqpack stats` and pass 1 of `seqpack pack` do per file, minus the spill), best of
``--repeats``; "labels" rows read the second column too (`ReadOptions.extra_columns`), where the
installed seqpack has it. Usage::

    .venv/bin/python -m benchmarks.readers_bench [--data PATH.npz] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import pathlib
import shutil
import tempfile
import time

import numpy as np

from seqpack.pipelines.formats.inputs import ReadOptions, read_lengths

ROOT = pathlib.Path(__file__).resolve().parents[1]


def write_inputs(data: pathlib.Path, tmp: pathlib.Path) -> dict[str, pathlib.Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    z = np.load(data)
    tokens, offsets, prompt = z["tokens"].astype(np.int32), z["offsets"], z["prompt_lengths"]
    labels = tokens.copy()
    for i, p in enumerate(prompt.tolist()):
        labels[offsets[i] : offsets[i] + p] = -100
    rows = [(tokens[a:b].tolist(), labels[a:b].tolist())
            for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
    text = "".join(json.dumps({"input_ids": t, "labels": y}) + "\n" for t, y in rows).encode()
    paths = {"jsonl": tmp / "sft.jsonl", "jsonl.gz": tmp / "sft.jsonl.gz",
             "parquet": tmp / "sft.parquet"}
    paths["jsonl"].write_bytes(text)
    paths["jsonl.gz"].write_bytes(gzip.compress(text, 6))
    lists = {name: pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(col))
             for name, col in (("input_ids", tokens), ("labels", labels))}
    pq.write_table(pa.table(lists), paths["parquet"])
    return paths


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "chat_sft_dev.npz"))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="readers-bench-"))
    try:
        paths = write_inputs(pathlib.Path(args.data), tmp)
        two = "extra_columns" in {f.name for f in dataclasses.fields(ReadOptions)}
        print("| input | size MiB | columns | seconds | M tokens/s |")
        print("|---|---|---|---|---|")
        for fmt, path in paths.items():
            if fmt == "jsonl.gz" and not two:
                continue  # the reader before compressed JSONL
            cases = [("input_ids", {})] + ([("+ labels", {"extra_columns": ("labels",)})]
                                            if two else [])
            for label, extra in cases:
                opts = ReadOptions(column="input_ids", **extra)
                lengths = read_lengths([str(path)], opts)[0]
                sec = best(lambda: read_lengths([str(path)], opts), args.repeats)  # noqa: B023
                print(f"| {fmt} | {path.stat().st_size / 2**20:.0f} | {label} | {sec:.2f} | "
                      f"{lengths.sum() / sec / 1e6:.1f} |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
