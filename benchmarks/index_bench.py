"""Packed by reference (`--format index`) against a copy (`--format arrayrecord`), one run.

The corpus is `--copies` x chat_dev, written once under `--work` in each input kind of
`--kinds`: Parquet (row groups of `--group-rows` examples), Arrow IPC files (record batches as
large), ArrayRecord (one SQP1 record an example), Megatron .bin/.idx (uint16) and stored .npz
(tokens + offsets), `--files` files of each. For each input kind both formats are packed
(`PackConfig(2048, overflow="split")`, `--workers`), then read through
`make_training_pipeline` (batches of 8 rows, `--read-workers` worker processes) for `--batches`
batches after the first. Printed: the output's bytes against the tokens' (as the inputs hold
them, and as the copy's shards hold them), the pack's seconds, and the rows per second read,
each also against the copy's, and the seconds to the first batch (medians of `--repeats` runs,
the formats alternating). `--s3`: inputs and outputs on moto's S3 emulator; an index of
Megatron inputs then read each way of `--remote` (by byte range, or from whole copies).
`--latency-ms`: instead, an index of Megatron inputs as file:// URLs read by byte range in one
process, each request round made to wait that long, one row at a time and with the source's
`read_threads`.

Usage (from the repo root)::

    python -m benchmarks.index_bench                          # 8 x chat_dev
    python -m benchmarks.index_bench --copies 2 --batches 200 --read-workers 2
    python -m benchmarks.index_bench --s3 --kinds arrayrecord,megatron   # on moto's S3
    python -m benchmarks.index_bench --copies 2 --latency-ms 0,10,30,60  # a store's round trip
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import numpy as np

from benchmarks.common import corpora

# parquet_disk: the Parquet inputs read by reference with their decoded row groups kept on
# local disk (SEQPACK_INDEX_DISK_CACHE), measured warm: after one read that fills the cache
KINDS = ("parquet", "parquet_disk", "arrow", "arrayrecord", "megatron", "npz")


def _write_megatron(prefix: pathlib.Path, seqs: list[np.ndarray]) -> str:
    """A Megatron-LM indexed dataset (uint16 tokens), as its `_IndexWriter` lays one out."""
    sizes = np.array([s.size for s in seqs], np.int32)
    pointers = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64) * 2
    with open(f"{prefix}.bin", "wb") as f:
        f.write(np.concatenate(seqs).astype(np.uint16).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(seqs), len(seqs) + 1))
        f.write(sizes.tobytes() + pointers.tobytes())
        f.write(np.arange(len(seqs) + 1, dtype=np.int64).tobytes())
    return f"{prefix}.bin"


def _write_one(kind: str, path: pathlib.Path, seqs: list[np.ndarray], group_rows: int) -> str:
    import pyarrow as pa

    kind = kind.removesuffix("_disk")
    import pyarrow.parquet as pq

    from seqpack.pipelines.formats.records import encode_row

    if kind == "megatron":
        return str(path.with_suffix(".bin")) if path.with_suffix(".bin").exists() else \
            _write_megatron(path, seqs)
    path = path.with_suffix("." + kind)
    if path.exists():
        return str(path)
    if kind in ("parquet", "arrow"):
        table = pa.table({"tokens": pa.array(seqs, pa.list_(pa.int32()))})
        if kind == "parquet":
            pq.write_table(table, path, row_group_size=group_rows)
        else:
            with pa.OSFile(str(path), "wb") as sink, \
                    pa.ipc.new_file(sink, table.schema) as w:
                for batch in table.to_batches(max_chunksize=group_rows):
                    w.write_batch(batch)
    elif kind == "arrayrecord":
        from array_record.python.array_record_module import ArrayRecordWriter

        w = ArrayRecordWriter(str(path), "group_size:1")
        for s in seqs:
            w.write(encode_row({"tokens": s}))
        w.close()
    else:  # npz, stored: memory-mapped by the reader
        np.savez(path, tokens=np.concatenate(seqs).astype(np.int32),
                 offsets=np.concatenate(([0], np.cumsum([s.size for s in seqs]))))
    return str(path)


def _write_inputs(work: pathlib.Path, copies: int, files: int, group_rows: int,
                  kinds: tuple[str, ...] = KINDS) -> dict:
    tokens, offsets = corpora(["chat_dev"])["chat_dev"]
    lengths = np.diff(offsets)
    n = lengths.size * copies
    out: dict[str, list[str]] = {kind: [] for kind in kinds}
    bounds = np.linspace(0, n, files + 1).astype(np.int64)
    for f in range(files):
        idx = np.arange(bounds[f], bounds[f + 1]) % lengths.size
        seqs = [tokens[offsets[i]:offsets[i + 1]].astype(np.int32) for i in idx]
        for kind in kinds:
            out[kind].append(_write_one(kind, work / f"part{f}", seqs, group_rows))
    return out


def _pack(paths: list[str], out: pathlib.Path | str, fmt: str, workers: int) -> float:
    from seqpack.packer import PackConfig
    from seqpack.pipelines.offline import PackJob, WriteOptions
    from seqpack.pipelines.offline import pack as run

    if isinstance(out, pathlib.Path):
        shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    run(PackJob(paths, str(out), PackConfig(2048, overflow="split"), workers=workers,
                write_options=WriteOptions(format=fmt)))
    return time.perf_counter() - start


def _rows_per_s(out: pathlib.Path | str, workers: int, batches: int,
                read_threads: int | None = None) -> tuple[float, float]:
    """(seconds to the first batch, rows per second over the next `batches`)."""
    from seqpack.pipelines.datasets import PackedSource, Prefetch, make_training_pipeline
    from seqpack.pipelines.datasets.training import ensure_flags_parsed

    ensure_flags_parsed()
    begin = time.perf_counter()
    it = iter(make_training_pipeline(PackedSource(str(out)), batch=8, shuffle_seed=0,
                                     num_epochs=None, prefetch=Prefetch(
                                         worker_count=workers, read_threads=read_threads)))
    next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    seconds = time.perf_counter() - start
    it.close()
    return start - begin, batches * 8 / seconds


def _bytes(out: pathlib.Path | str, suffix: str) -> int:
    if isinstance(out, str):  # a URL prefix
        import fsspec

        fs, root = fsspec.core.url_to_fs(out)
        return sum(int(i["size"]) for i in fs.ls(root, detail=True)
                   if i["name"].endswith(suffix))
    return sum(p.stat().st_size for p in out.glob(f"*{suffix}"))


@contextlib.contextmanager
def _s3(work: pathlib.Path) -> Iterator[str]:
    """A moto S3 server (the tests' emulator) with a bucket; yields its s3:// root and points
    the standard variables at it; each read then fills a fresh download cache."""
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    server = shutil.which("moto_server") or str(pathlib.Path(sys.executable).parent /
                                                "moto_server")
    proc = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/bench", method="PUT"),
                               timeout=10).close()
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing",
                          AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                          AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)
        yield "s3://bench"
    finally:
        proc.terminate()
        proc.wait()


def _upload(paths: list[str], url: str) -> list[str]:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    out = []
    for p in paths:
        for q in ([p, p[:-4] + ".idx"] if p.endswith(".bin") else [p]):
            fs.put_file(q, f"{root}/{pathlib.Path(q).name}")
        name = pathlib.Path(p).name  # a Megatron pair by its .idx: a .bin URL names no format
        out.append(f"{url}/{name[:-4] + '.idx' if name.endswith('.bin') else name}")
    return out


def _latency_rows(work: pathlib.Path, latencies: list[float], args: argparse.Namespace) -> None:
    """An index of Megatron inputs named as file:// URLs (fsspec, as gs:// or s3://) read by
    byte range in this process, each `storage.read_ranges` call first waiting `ms` (a store's
    round trip; the ranges of one call wait together): rows/s one row at a time against the
    source's `read_threads` (16 rows in flight)."""
    from seqpack.pipelines import storage

    paths = _write_inputs(work, args.copies, args.files, args.group_rows, ("megatron",))
    urls = ["file://" + p[:-4] + ".idx" for p in paths["megatron"]]
    out = work / "out-latency"
    _pack(urls, out, "index", args.workers)
    os.environ["SEQPACK_INDEX_REMOTE"] = "ranges"
    read = storage.read_ranges
    print("| round trip ms | rows/s, one at a time | rows/s, read_threads (16) | speed-up |")
    print("|---|---|---|---|")
    for ms in latencies:
        def waiting(*a, ms=ms):
            time.sleep(ms / 1e3)
            return read(*a)

        storage.read_ranges = waiting
        rates = [_rows_per_s(out, 0, args.batches, threads)[1] for threads in (0, None)]
        print(f"| {ms:g} | {rates[0]:,.0f} | {rates[1]:,.0f} | {rates[1] / rates[0]:.2f}x |",
              flush=True)
    storage.read_ranges = read


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--copies", type=int, default=8)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--group-rows", type=int, default=1024)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--read-workers", type=int, default=8)
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--work", default=None)
    p.add_argument("--kinds", default=",".join(KINDS), help="input kinds, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="runs of each; medians printed")
    p.add_argument("--s3", action="store_true", help="inputs and outputs on a moto S3 server "
                   "(seqpack[cloud] and moto, as the tests use); reads fill a fresh cache")
    p.add_argument("--remote", default="copy,ranges", help="with --s3: how an index reads its "
                   "Megatron inputs (SEQPACK_INDEX_REMOTE), comma-separated")
    p.add_argument("--latency-ms", default=None, help="instead: an index read by byte range "
                   "with each request round made to wait this long (comma-separated ms)")
    args = p.parse_args()
    work = pathlib.Path(args.work or tempfile.mkdtemp(prefix="index_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    if args.latency_ms is not None:
        _latency_rows(work, [float(x) for x in args.latency_ms.split(",")], args)
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
        return
    inputs = _write_inputs(work, args.copies, args.files, args.group_rows,
                           tuple(args.kinds.split(",")))
    _, offsets = corpora(["chat_dev"])["chat_dev"]
    n_tokens = int(offsets[-1]) * args.copies
    print(f"\n{args.copies} x chat_dev: {n_tokens:,} tokens in {args.files} files "
          f"(Parquet row groups, Arrow record batches of {args.group_rows}); pack workers "
          f"{args.workers}, read workers {args.read_workers}\n")
    print("| inputs | format | output MB | vs int32 tokens | vs the copy | pack s | vs the copy "
          "| first batch s | rows/s read | vs the copy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with contextlib.ExitStack() as stack:
        root = stack.enter_context(_s3(work)) if args.s3 else None
        for kind, paths in inputs.items():
            if root is not None:
                paths = _upload(paths, f"{root}/in-{kind}")
            _table_rows(kind, paths, work, root, n_tokens, args)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


def _table_rows(kind: str, paths: list[str], work: pathlib.Path, root: str | None,
                n_tokens: int, args: argparse.Namespace) -> None:
    modes = args.remote.split(",") if root is not None and kind == "megatron" else [""]
    runs: dict[str, list[tuple[float, float, float]]] = {}
    sizes = {}
    for r in range(args.repeats):  # the formats alternate: the machine's drift hits them all
        for fmt, suffix, read_modes in (("arrayrecord", ".arrayrecord", [""]),
                                        ("index", ".index", modes)):
            out: pathlib.Path | str = work / f"out-{kind}-{fmt}" if root is None else \
                f"{root}/out-{kind}-{fmt}-{r}"
            seconds = _pack(paths, out, fmt, args.workers)
            for mode in read_modes:
                name = f"{fmt} ({mode})" if mode else fmt
                if root is not None:
                    os.environ["SEQPACK_CACHE_DIR"] = tempfile.mkdtemp(dir=work, prefix="cache-")
                os.environ["SEQPACK_INDEX_REMOTE"] = mode or "copy"
                sizes[name] = _bytes(out, suffix)
                disk = kind.endswith("_disk") and fmt == "index"
                if disk:
                    os.environ["SEQPACK_INDEX_DISK_CACHE"] = tempfile.mkdtemp(dir=work)
                    _rows_per_s(out, args.read_workers, args.batches)  # fills the cache
                runs.setdefault(name, []).append(
                    (seconds, *_rows_per_s(out, args.read_workers, args.batches)))
                if disk:
                    shutil.rmtree(os.environ.pop("SEQPACK_INDEX_DISK_CACHE"))
    results = {name: (sizes[name], *np.median(np.array(r), axis=0)) for name, r in runs.items()}
    copy, copy_s, _, copy_rate = results["arrayrecord"]
    for name, (size, seconds, first, rate) in results.items():
        print(f"| {kind} | {name} | {size / 1e6:,.1f} | {size / (4 * n_tokens):.2%} | "
              f"{size / copy:.2%} | {seconds:.2f} | {copy_s / seconds:.2f}x | {first:.2f} | "
              f"{rate:,.0f} | {rate / copy_rate:.0%} |", flush=True)


if __name__ == "__main__":
    main()
