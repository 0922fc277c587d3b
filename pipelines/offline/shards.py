"""Shard writing: packed rows -> one shard file in the run's encoding (`--format`).

Both runners write every shard through `write_shard` (the local runner from its spill, the Beam
job from the parts its inputs send): the rows of one shard are assembled by `packer.build_rows`,
encoded by the run's `formats.encodings.Encoding` (SQP1 records in ArrayRecord by default,
Parquet for the others) into ``name.<attempt>.tmp`` in the output's staging directory, then
published under `name` (a rename, or an upload) and followed by the shard's completion record
``name.done`` (rows, size, sha256: what ``--resume`` trusts).

A shard that cannot be written (disk full, out of inodes, no permission) raises `RunFailed`
naming the file; its ``.tmp`` is removed, so what is left is a state ``--resume`` finishes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from seqpack.packer import PackConfig, PackPlan
from seqpack.packer.contract import restore_derived
from seqpack.pipelines import storage
from seqpack.pipelines.errors import InputError, RunFailed
from seqpack.pipelines.formats import encodings
from seqpack.pipelines.formats.encodings import (
    COMPRESSIONS,
    Encoding,
    Layout,
    loss_positions,
    of_manifest,
    shard_batch,
    with_segment_ids,
)
from seqpack.pipelines.formats.manifest import Manifest, file_digest, read_manifest
from seqpack.pipelines.offline.outdir import OutputDir, as_output_dir, write_done


@dataclasses.dataclass(frozen=True)
class WriteOptions:
    """How the rows are stored."""

    shard_rows: int = 1024  # packed rows per shard file
    compression: str = "none"  # one of encodings.COMPRESSIONS
    fsync: bool = False  # fsync each shard before its rename (durability beyond process crashes)
    # Also store f_segment_ids / f_positions (arrayrecord). Off: readers rebuild them from the
    # [S] metadata (`packer.contract.restore_derived`), and the shards are a third of the size.
    store_derived: bool = False
    format: str = encodings.DEFAULT  # the shards' encoding: one of encodings.FORMATS

    def __post_init__(self) -> None:
        if isinstance(self.shard_rows, bool) or not isinstance(self.shard_rows, int) \
                or self.shard_rows < 1:
            raise ValueError(f"shard_rows={self.shard_rows!r} must be an int >= 1")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression={self.compression!r} must be one of "
                             f"{list(COMPRESSIONS)}")
        encodings.encoding(self.format)  # ValueError naming format=

    @property
    def encoding(self) -> Encoding:
        return encodings.encoding(self.format)

    def layout(self, config: PackConfig, columns: Sequence[Mapping[str, Any]] = (), *,
               mixed: bool = False, firsts: np.ndarray | None = None) -> Layout:
        """The rows' `Layout` for `config` and the manifest's `columns` entries (`mixed`, or
        its datasets' first corpus examples `firsts`: rows of a mixture)."""
        return Layout(config, tuple(columns), self.compression, self.store_derived,
                      mixed or firsts is not None,
                      None if firsts is None else tuple(int(f) for f in firsts))


def stored_keys(config: PackConfig, options: WriteOptions,
                columns: Sequence[Mapping[str, Any]] = ()) -> list[str]:
    """The keys each stored row holds (the encoding's; for arrayrecord: the contract's, segment
    ids / positions only with store_derived, then each extra column's)."""
    return options.encoding.stored_keys(options.layout(config, columns))


def row_dtype(values_dtype: np.dtype, pad_id: int) -> np.dtype:
    """The rows' dtype of a column (tokens, labels, a mask): the inputs' dtype, widened only
    when `pad_id` is outside its range (an int8 mask padded with 0 stays int8)."""
    dtype = np.dtype(values_dtype)
    if dtype.kind not in "iu":
        fits = np.can_cast(np.min_scalar_type(pad_id), dtype)
        return dtype if fits else np.result_type(dtype, np.min_scalar_type(pad_id))
    lo, hi = min(np.iinfo(dtype).min, pad_id), max(np.iinfo(dtype).max, pad_id)
    other = "i" if dtype.kind == "u" else "u"
    for size in (1, 2, 4, 8):  # the narrowest integer type holding the ids and the pad
        for kind in (dtype.kind, other):
            wider = np.dtype(f"{kind}{size}")
            if size >= dtype.itemsize and np.iinfo(wider).min <= lo and hi <= np.iinfo(wider).max:
                return wider
    raise InputError(f"pad {pad_id} and the {dtype} ids of its column fit no integer type: pass "
                     "a pad within int64 (for uint64 ids: one >= 0)")


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
                columns: Mapping[str, np.ndarray] | None = None,
                entries: Sequence[Mapping[str, Any]] = (), firsts: np.ndarray | None = None
                ) -> tuple[tuple[int, str], int]:
    """Assembles the rows of plan `p` (one shard's rows, numbered from 0) and writes them.

    `pieces[i]` holds the tokens of the plan's i-th piece (or `values` the rows' tokens already
    in place, see `packer.build_rows`; neither for rows by reference with no `entries`);
    `columns` each extra column's `[R, L]` values in place (`packer.fill_rows`), `entries` the
    manifest's entries of those columns; `firsts`: a mixture's datasets' first corpus examples
    (`mixture.firsts_of`: the rows then carry `segment_dataset_id` and each example's index
    within its dataset). Writes ``name.<attempt>.tmp`` in the output's staging directory,
    published as `name` when complete (a rename, or an upload), then the shard's completion
    record (`name` + ".done": rows, size, sha256); returns ((size, sha256), the rows' loss
    tokens: `encodings.loss_positions`). RunFailed naming the file when the system
    refuses the write.
    """
    out = as_output_dir(output_dir)
    # A name of its own per attempt: a runner may run two attempts of one shard at once
    # (Dataflow's backup tasks); each publishes a complete file under `name`, the same bytes.
    tmp = os.path.join(out.staging(), f"{name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    layout = options.layout(config, entries, firsts=firsts)
    encoding = options.encoding
    if encoding.by_reference and not entries:  # the plan alone: no tokens needed
        batch, loss = {}, plan_loss_tokens(p.length)
    else:
        batch = shard_batch(p, layout, dtype=dtype, derived=encoding.wants_derived(layout),
                            pieces=pieces, values=values, columns=columns)
        loss = int(loss_positions(batch, layout).sum())
    try:
        if encoding.by_reference:
            encoding.write_refs(tmp, p, layout, dtype)
        else:
            encoding.write(tmp, batch, layout)
        del batch
        if options.fsync:
            _fsync(tmp)
        digest = file_digest(tmp)
        out.publish(tmp, name)
        if options.fsync and not out.remote:
            _fsync(out.location)  # the rename itself
        write_done(out, name, p.num_rows, digest)
    except (OSError, RuntimeError) as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise RunFailed.of(e, out.path(name), "cannot write the shard") from None
    return digest, loss


def plan_loss_tokens(lengths: np.ndarray) -> int:
    """The loss tokens of rows with no labels or mask columns, from their pieces' lengths: a
    piece of n tokens is a segment whose n - 1 positions have a next token
    (`encodings.loss_positions` of the same rows)."""
    n = np.asarray(lengths, np.int64)
    return int((n - (n > 0)).sum())


def read_shard(output_dir: str, name: str, num_rows: int | None = None, *,
               restore: bool = True, manifest: Manifest | None = None
               ) -> dict[str, np.ndarray]:
    """All rows of one shard stacked into `[R, ...]` arrays, as its encoding reads them back
    (`Encoding.read`, for `manifest`'s; default: the output's own manifest); InputError if it
    is corrupt. `restore=False`: without the segment ids / positions a shard does not store. A
    shard on object storage is read from a temporary local copy."""
    if manifest is None:
        manifest = read_manifest(output_dir, check_shards=False)
    encoding, layout = of_manifest(manifest)
    url = storage.join(output_dir, name)
    with storage.local_copy(url) as local, storage.named(local, url):
        batch = encoding.read(local, layout, num_rows)
    return restore_derived(batch) if restore and batch else batch


def loss_tokens(rows: Mapping[str, np.ndarray], manifest: Manifest) -> int:
    """The loss tokens of a shard's rows as `read_shard` gives them (`Encoding.loss_mask`)."""
    encoding, layout = of_manifest(manifest)
    return int(encoding.loss_mask(with_segment_ids(rows, layout.config), layout).sum())
