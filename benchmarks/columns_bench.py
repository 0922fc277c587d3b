"""Two columns against one: `seqpack pack` of an SFT corpus with and without its labels.

``../shared/data/chat_sft_dev.npz`` (30,590 chat pairs as ``[CLS] instruction [SEP] response
[SEP]``, labels -100 on each prompt) is written once as one Parquet file with ``input_ids`` and
``labels`` (``list<int32>`` each) under ``--work``. Then, as subprocesses, each timed and its
process tree's peak RSS sampled (`benchmarks.scale_bench.run_measured`), in alternation
(``--repeats`` times, best wall time kept):

    one column   seqpack pack sft.parquet -o OUT --column input_ids --seq-len L --overflow split
    two columns  ... --column input_ids --column labels --pad labels=-100
    verify       seqpack verify OUT (each output)

and the outputs' sizes. Without the corpus it prints a note and exits.

    .venv/bin/python -m benchmarks.columns_bench [--seq-len 2048] [--workers 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys

import numpy as np

from benchmarks.common import DATA, print_table
from benchmarks.scale_bench import dir_bytes, run_measured


def write_sft(path: pathlib.Path) -> tuple[int, int]:
    """chat_sft_dev as Parquet (input_ids, labels); returns (examples, tokens)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    z = np.load(DATA / "chat_sft_dev.npz")
    tokens, offsets, prompt = z["tokens"], z["offsets"].astype(np.int64), z["prompt_lengths"]
    labels = tokens.astype(np.int32)
    starts = offsets[:-1]
    in_prompt = np.zeros(tokens.size + 1, np.int64)
    np.add.at(in_prompt, starts, 1)
    np.add.at(in_prompt, starts + prompt, -1)
    labels[np.cumsum(in_prompt)[:-1] > 0] = -100
    if not path.exists():
        o = pa.array(offsets.astype(np.int32))
        column = lambda values: pa.ListArray.from_arrays(o, pa.array(values))  # noqa: E731
        table = pa.table({"input_ids": column(tokens.astype(np.int32)), "labels": column(labels)})
        pq.write_table(table, str(path) + ".tmp")
        path.with_suffix(".parquet.tmp").rename(path)
    return int(offsets.size - 1), int(tokens.size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", default="/tmp/seqpack-columns")
    args = ap.parse_args()
    if not (DATA / "chat_sft_dev.npz").exists():
        print(f"no {DATA / 'chat_sft_dev.npz'}: nothing to measure")
        return
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    src = work / "sft.parquet"
    examples, tokens = write_sft(src)
    base = [sys.executable, "-m", "seqpack.cli", "pack", str(src), "--seq-len",
            str(args.seq_len), "--overflow", "split", "--workers", str(args.workers),
            "--column", "input_ids"]
    runs = {"one column (input_ids)": [], "two columns (+ labels)": ["--column", "labels",
                                                                     "--pad", "labels=-100"]}
    best: dict[str, list] = {}
    for _ in range(args.repeats):
        for name, extra in runs.items():
            out = work / name.split()[0]
            shutil.rmtree(out, ignore_errors=True)
            seconds, peak, _ = run_measured([*base, "-o", str(out), *extra])
            check, check_peak, _ = run_measured([sys.executable, "-m", "seqpack.cli", "verify",
                                                 str(out), "--workers", str(args.workers)])
            size = dir_bytes(out)
            if name not in best or seconds < best[name][0]:
                best[name] = [seconds, peak, size, check, check_peak]
    rows = [[name, f"{s:.2f}", f"{tokens / s / 1e6:.1f}M", f"{p / 2**20:,.0f}",
             f"{b / 2**20:,.1f}", f"{c:.2f}", f"{cp / 2**20:,.0f}"]
            for name, (s, p, b, c, cp) in best.items()]
    print_table(f"seqpack pack chat_sft_dev ({examples:,} examples, {tokens / 1e6:.1f}M tokens), "
                f"L={args.seq_len}, {args.workers} workers, best of {args.repeats}",
                ["run", "pack s", "tokens/s", "peak RSS MiB", "output MiB", "verify s",
                 "verify peak MiB"], rows)


if __name__ == "__main__":
    main()
