"""Input checks for the segment kernels: static (shapes, dtypes, SMEM) and metadata values.

Static checks run at trace time inside every public function. `validate_segments` checks the
values of the metadata against the packed-row contract (docs/contract.md); it needs concrete
arrays, so call it before `jax.jit` (e.g. once per batch in the input pipeline, or in tests):

    offsets  [[0, 5, 9, 9]]    lengths [[5, 4, 0, 0]]   seq_len 12   ok (slots 2, 3 unused)
    offsets  [[0, 4, 9, 9]]    lengths [[5, 4, 0, 0]]   seq_len 12   error: slot 0 overlaps slot 1
    offsets  [[0, 5, 13, 13]]  lengths [[5, 4, 0, 0]]   seq_len 12   error: offset 13 > seq_len
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from seqpack.kernels.common import SMEM_METADATA_BUDGET_BYTES

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_metadata(
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    batch: int,
) -> int:
    """Checks the [B, S] metadata shapes and integer dtypes; returns S."""
    shape = segment_offsets.shape
    if segment_offsets.ndim != 2 or shape[0] != batch:
        raise ValueError(
            f"segment_offsets.shape={shape} must be [B, S] with B={batch}; pass the batch's "
            "'<feature>_segment_offsets' stacked over rows"
        )
    if segment_lengths.shape != shape:
        raise ValueError(
            f"segment_lengths.shape={segment_lengths.shape} must equal "
            f"segment_offsets.shape={shape}; both come from the same packed batch"
        )
    for name, arr in (("segment_offsets", segment_offsets), ("segment_lengths", segment_lengths)):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name}.dtype={arr.dtype} must be an integer dtype (int32)")
    if shape[1] < 1:
        raise ValueError(f"segment_offsets.shape={shape} needs S >= 1 slots")
    return shape[1]


def check_tokens_input(name: str, x: jax.Array, *, feature_axis: bool = True) -> None:
    """x must be [B, L] or [B, L, D] (only [B, L] when `feature_axis` is False), a float dtype."""
    ndims = (2, 3) if feature_axis else (2,)
    if x.ndim not in ndims:
        want = "[B, L] or [B, L, D]" if feature_axis else "[B, L]"
        raise ValueError(f"{name}.shape={x.shape} must be {want}")
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise ValueError(
            f"{name}.dtype={x.dtype} must be one of float32, bfloat16, float16; cast it first"
        )
    if x.shape[1] < 1:
        raise ValueError(f"{name}.shape={x.shape} needs L >= 1")


def float_dtype(name: str, value) -> jnp.dtype:
    """An option's dtype, or a ValueError naming the option unless a float one."""
    dtype = jnp.dtype(value)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}={dtype} must be float32, bfloat16 or float16")
    return dtype


def check_smem(batch: int, num_segments: int) -> None:
    """The flattened offsets + lengths (2 x B x S i32) and row ends (B i32) must fit the budget."""
    per_row = 4 * (2 * num_segments + 1)
    needed = per_row * batch
    if needed > SMEM_METADATA_BUDGET_BYTES:
        max_rows = max(SMEM_METADATA_BUDGET_BYTES // per_row, 1)
        raise ValueError(
            f"B * S = {batch} * {num_segments} metadata entries need {needed} bytes of SMEM, over "
            f"the {SMEM_METADATA_BUDGET_BYTES}-byte budget; call the kernel on chunks of at most "
            f"{max_rows} rows (e.g. jax.lax.map over x.reshape(n, B // n, ...)), lower "
            "max_segments, or pass impl='reference'"
        )


def validate_segments(
    segment_offsets: object,  # int[B, S] (or [S] for one row)
    segment_lengths: object,  # int[B, S] (or [S])
    *,
    seq_len: int,
    context_parallel: int | None = None,
) -> None:
    """Checks metadata values against the row contract; raises ValueError naming the first bad slot.

    Offsets must lie in [0, seq_len], lengths be >= 0, every segment end within seq_len, offsets
    non-decreasing and segments non-overlapping (offsets[j + 1] >= offsets[j] + lengths[j]);
    with `context_parallel` C (rows for ring attention over C ranks), every used segment's
    offset a multiple of 2C, as the load-balanced layout needs (rows packed with
    context_parallel=C are). Needs concrete values: call it outside `jax.jit`.
    """
    try:
        offsets = np.asarray(segment_offsets)
        lengths = np.asarray(segment_lengths)
    except jax.errors.TracerArrayConversionError:
        raise ValueError(
            "validate_segments needs concrete arrays; call it before jax.jit (on the host batch)"
        ) from None
    if offsets.ndim == 1:
        offsets, lengths = offsets[None], lengths[None]
    if offsets.ndim != 2 or offsets.shape != lengths.shape:
        raise ValueError(
            f"segment_offsets.shape={offsets.shape} and segment_lengths.shape={lengths.shape} "
            "must both be [B, S]"
        )
    for name, arr in (("segment_offsets", offsets), ("segment_lengths", lengths)):
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{name}.dtype={arr.dtype} must be an integer dtype")
    if seq_len < 1:
        raise ValueError(f"{seq_len=} must be >= 1")
    offsets = offsets.astype(np.int64)
    lengths = lengths.astype(np.int64)
    ends = offsets + lengths
    checks = (
        (lengths < 0, "segment_lengths", lengths, "must be >= 0"),
        ((offsets < 0) | (offsets > seq_len), "segment_offsets", offsets,
         f"must be in [0, {seq_len=}]"),
        (ends > seq_len, "segment end (offset + length)", ends, f"must be <= {seq_len=}"),
    )
    for bad, name, values, rule in checks:
        if bad.any():
            row, slot = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"{name}[{row}, {slot}]={int(values[row, slot])} {rule}; rebuild the batch with "
                "the packer or fix the metadata"
            )
    if context_parallel is not None:
        bad = (lengths > 0) & (offsets % (2 * context_parallel) != 0)
        if bad.any():
            row, slot = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"segment_offsets[{row}, {slot}]={int(offsets[row, slot])} is not a multiple of "
                f"2 x context_parallel = {2 * context_parallel}: pack the rows with "
                f"context_parallel={context_parallel} for ring attention over that many ranks")
    if offsets.shape[1] > 1:
        backwards = offsets[:, 1:] < offsets[:, :-1]
        overlap = offsets[:, 1:] < ends[:, :-1]
        for bad, rule in ((backwards, "offsets must be non-decreasing"),
                          (overlap, "segments must not overlap")):
            if bad.any():
                row, slot = (int(i) for i in np.argwhere(bad)[0])
                raise ValueError(
                    f"row {row}: slot {slot} [{offsets[row, slot]}, {ends[row, slot]}) then slot "
                    f"{slot + 1} at offset {offsets[row, slot + 1]}: {rule}; slots must be in row "
                    "order (unused slots hold the row's used length)"
                )
