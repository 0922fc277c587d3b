"""`seqpack pack --mix`: the realized token shares against the weights, their spread per step,
and rows and time against the unmixed packing of the same examples.

The datasets: chat_dev (30,590 examples, mean 384 tokens) and gsm8k_train (7,473, mean 158)
from ``../shared/data``, each written as one Parquet file of `tokens` (`list<int32>`). Each case
runs `seqpack pack --mix chat=... --mix math=... --weights ...` as a subprocess (L = --seq-len,
best fit decreasing, --overflow split, shuffled rows, --workers), then `seqpack stats --json
--batch-size B` for the shares per step of B rows; the unmixed run packs the very examples the
mixture took (with their repeats: `offline.mixture.hashed.select_inputs` on the same lengths),
as one Parquet file in the mixed stream's order, with the same options. Times are wall-clock
of the whole command.
Usage::

    python -m benchmarks.mix_offline_bench [--seq-len 4096] [--batch-size 64] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.common import DATA, print_table

CASES = [  # (weights, --mix-tokens)
    ({"chat": 0.5, "math": 0.5}, None),
    ({"chat": 0.5, "math": 0.5}, 4_000_000),
    ({"chat": 0.2, "math": 0.8}, 4_000_000),
]


def _write(path: str, tokens: np.ndarray, offsets: np.ndarray) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    values = pa.array(tokens.astype(np.int32))
    pq.write_table(pa.table({"tokens": pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32)), values)}), path)
    return path


def _seqpack(*args: object) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "seqpack.cli", *map(str, args)],
                          capture_output=True, text=True, check=True)
    return time.perf_counter() - t0, done.stdout


def main() -> None:
    from seqpack.pipelines.offline.mixture import MixSpec, hashed

    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    data = {name: np.load(DATA / f"{file}.npz") for name, file in
            (("chat", "chat_dev"), ("math", "gsm8k_train"))}
    common = ["--seq-len", a.seq_len, "--max-segments", 256, "--overflow", "split",
              "--workers", a.workers]
    rows_out = []
    with tempfile.TemporaryDirectory(prefix="seqpack-mix-") as d:
        files = {n: _write(os.path.join(d, f"{n}.parquet"), z["tokens"], z["offsets"])
                 for n, z in data.items()}
        lengths = [np.diff(data[n]["offsets"]) for n in ("chat", "math")]
        for k, (weights, mix_tokens) in enumerate(CASES):
            out = os.path.join(d, f"mixed{k}")
            mix = ["--mix", f"chat={files['chat']}", "--mix", f"math={files['math']}",
                   "--weights", ",".join(f"{n}={w}" for n, w in weights.items())]
            if mix_tokens:
                mix += ["--mix-tokens", mix_tokens]
            t_mix, _ = _seqpack("pack", *mix, "-o", out, *common)
            stats = json.loads(_seqpack("stats", out, "--json", "--batch-size",
                                        a.batch_size)[1])
            # the same examples, unmixed: the stream as one input
            spec = MixSpec([("chat", ["c"]), ("math", ["m"])], weights, mix_tokens=mix_tokens)
            s = hashed.select_inputs(spec, lengths, [None, None], 1 << 22)
            starts = np.concatenate([data["chat"]["offsets"][:-1],
                                     data["math"]["offsets"][:-1] + data["chat"]["offsets"][-1]])
            tokens = np.concatenate([data["chat"]["tokens"], data["math"]["tokens"]])
            at = np.concatenate([np.arange(starts[r], starts[r] + n) for r, n in
                                 zip(s.ref.tolist(), s.lengths.tolist())])
            plain = _write(os.path.join(d, f"plain{k}.parquet"), tokens[at],
                           np.concatenate(([0], np.cumsum(s.lengths))))
            t_plain, _ = _seqpack("pack", plain, "-o", os.path.join(d, f"plain{k}"), *common)
            plain_rows = json.loads(_seqpack("stats", os.path.join(d, f"plain{k}"),
                                             "--json")[1])["stats"]["best_fit_decreasing"][
                "num_rows"]
            mixed_rows = stats["stats"]["best_fit_decreasing"]["num_rows"]
            for ds in stats["mixture"]["datasets"]:
                p = ds["step_share"]
                rows_out.append([
                    f"{'/'.join(f'{w:g}' for w in weights.values())}"
                    f"{f' N={mix_tokens / 1e6:g}M' if mix_tokens else ''}", ds["name"],
                    f"{ds['weight']:.2%}", f"{ds['tokens']:,}", f"{ds['token_share']:.3%}",
                    f"{ds['repetitions']:.2f}x",
                    f"{p['p5']:.1%} / {p['p50']:.1%} / {p['p95']:.1%}",
                    f"{mixed_rows:,} vs {plain_rows:,}",
                    f"{t_mix:.1f} vs {t_plain:.1f}"])
    print_table(f"seqpack pack --mix (L = {a.seq_len}, steps of {a.batch_size} rows, "
                f"{a.workers} workers)",
                ["weights", "dataset", "target", "tokens", "realized", "repeated",
                 "per step p5 / p50 / p95", "rows: mixed vs unmixed", "s: mixed vs unmixed"],
                rows_out)


if __name__ == "__main__":
    main()
