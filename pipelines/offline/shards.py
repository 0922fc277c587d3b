"""Shard encoding and writing: packed rows -> SQP1 records -> one ArrayRecord shard file.

Both runners write every shard through `write_shard` (the local runner from its spill, the Beam
job from the parts its inputs send): the rows of one shard are assembled by `packer.build_rows`,
encoded as SQP1 records (`formats.records`; every row of a run has the same layout, so
`RowEncoder` computes the record header once and joins each row's arrays around it) and written
to ``name.<attempt>.tmp`` in the output's staging directory, then published under `name` (a
rename, or an upload) and followed by the shard's completion record ``name.done`` (rows, size,
sha256: what ``--resume`` trusts).

A shard that cannot be written (disk full, out of inodes, no permission) raises `RunFailed`
naming the file; its ``.tmp`` is removed, so what is left is a state ``--resume`` finishes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import sys
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from seqpack.packer import PackConfig, PackPlan, build_rows
from seqpack.pipelines.errors import RunFailed, require
from seqpack.pipelines.formats.manifest import file_digest
from seqpack.pipelines.formats.records import decode_row, encode_row
from seqpack.pipelines.offline.outdir import OutputDir, as_output_dir, write_done

COMPRESSION = {"none": "uncompressed", "snappy": "snappy", "zstd": "zstd:3"}


@dataclasses.dataclass(frozen=True)
class WriteOptions:
    """How the rows are stored."""

    shard_rows: int = 1024  # packed rows per shard file
    compression: str = "none"  # a key of COMPRESSION
    fsync: bool = False  # fsync each shard before its rename (durability beyond process crashes)
    # Also store f_segment_ids / f_positions. Off: readers rebuild them from the [S] metadata
    # (`packer.contract.restore_derived`), and the shards are about a third of the size.
    store_derived: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.shard_rows, bool) or not isinstance(self.shard_rows, int) \
                or self.shard_rows < 1:
            raise ValueError(f"shard_rows={self.shard_rows!r} must be an int >= 1")
        if self.compression not in COMPRESSION:
            raise ValueError(f"compression={self.compression!r} must be one of {list(COMPRESSION)}")

    @property
    def arrayrecord_options(self) -> str:
        return f"group_size:1,{COMPRESSION[self.compression]}"


def stored_keys(config: PackConfig, options: WriteOptions, columns: Sequence[str] = ()
                ) -> list[str]:
    """The keys each record holds: the contract's (segment ids / positions only with
    store_derived), then each extra column's."""
    k = config.keys()
    derived = () if options.store_derived else k.derived
    return [name for name in k.roles().values() if name not in derived] + list(columns)


def row_dtype(values_dtype: np.dtype, pad_id: int) -> np.dtype:
    """The rows' token dtype: the inputs' dtype, widened when it cannot hold `pad_id`."""
    dtype = np.dtype(values_dtype)
    if not np.can_cast(np.min_scalar_type(pad_id), dtype):
        dtype = np.result_type(dtype, np.min_scalar_type(pad_id))
    return dtype


class RowEncoder:
    """SQP1 records for the rows of a batch; same bytes as `encode_row` row by row."""

    def __init__(self, batch: dict[str, np.ndarray]):
        self.keys = list(batch)
        template = encode_row({k: batch[k][0] for k in self.keys})
        views = decode_row(template, restore=False)
        base = np.frombuffer(template, np.uint8).ctypes.data
        self.parts: list = []
        self.slots: list[int] = []
        pos = 0
        for k in self.keys:
            start = views[k].ctypes.data - base
            assert views[k].nbytes and start >= pos, k
            self.parts.append(template[pos:start])
            self.slots.append(len(self.parts))
            self.parts.append(b"")
            pos = start + views[k].nbytes
        self.parts.append(template[pos:])
        self.fast = sys.byteorder == "little"

    def records(self, batch: dict[str, np.ndarray]) -> Iterator[bytes]:
        """Yields the record of each row in order."""
        arrays = [np.ascontiguousarray(batch[k]) for k in self.keys]
        num_rows = arrays[0].shape[0]
        if not self.fast:  # pragma: no cover - big-endian hosts
            for r in range(num_rows):
                yield encode_row({k: a[r] for k, a in zip(self.keys, arrays)})
            return
        parts, slots = list(self.parts), self.slots
        for r in range(num_rows):
            for slot, a in zip(slots, arrays):
                parts[slot] = a[r].data
            yield b"".join(parts)


def _open_writer(path: str, options: str):
    module = require("array_record.python.array_record_module", "writing shards")
    return module.ArrayRecordWriter(path, options)


def _fsync(path: str) -> None:
    """fsync a file or a directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_shard(output_dir: str | OutputDir, name: str, pieces: Sequence[np.ndarray] | None,
                p: PackPlan, config: PackConfig, options: WriteOptions, *, dtype: np.dtype,
                values: np.ndarray | None = None,
                columns: Mapping[str, np.ndarray] | None = None) -> tuple[int, str]:
    """Assembles the rows of plan `p` (one shard's rows, numbered from 0) and writes them.

    `pieces[i]` holds the tokens of the plan's i-th piece (or `values` the rows' tokens already
    in place, see `packer.build_rows`); `columns` each extra column's `[R, L]` values in place
    (`packer.fill_rows`). Writes ``name.<attempt>.tmp`` in the output's staging
    directory, published as `name` when complete (a rename, or an upload), then the shard's
    completion record (`name` + ".done": rows, size, sha256); returns (size, sha256). RunFailed
    naming the file when the system refuses the write.
    """
    out = as_output_dir(output_dir)
    # A name of its own per attempt: a runner may run two attempts of one shard at once
    # (Dataflow's backup tasks); each publishes a complete file under `name`, the same bytes.
    tmp = os.path.join(out.staging(), f"{name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    batch = build_rows(pieces, p, config, dtype=dtype, derived=options.store_derived,
                       values=values, columns=columns)
    try:
        _write_records(tmp, RowEncoder(batch).records(batch), options)
        del batch
        digest = file_digest(tmp)
        out.publish(tmp, name)
        if options.fsync and not out.remote:
            _fsync(out.location)  # the rename itself
        write_done(out, name, p.num_rows, digest)
    except (OSError, RuntimeError) as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise RunFailed.of(e, out.path(name), "cannot write the shard") from None
    return digest


def _write_records(path: str, records: Iterator[bytes], options: WriteOptions) -> None:
    writer = _open_writer(path, options.arrayrecord_options)
    try:
        for record in records:
            writer.write(record)
    finally:
        writer.close()  # raises what a failed write left (RuntimeError naming the cause)
    if options.fsync:
        _fsync(path)
