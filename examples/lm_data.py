"""The inputs of the example models: corpora, the mixture pipeline, its batches packed and padded.

- `load_corpus`: a token corpus `.npz` (`tokens`, `offsets`: example i is
  tokens[offsets[i]:offsets[i + 1]]) as a random-access source; `smoke_corpora`: two small
  generated datasets (no files), for `--smoke` and tests; both in `token_dtype(vocab)`, one
  dtype for every corpus of a run.
- `pipeline`: `make_training_pipeline` over a token-weighted `Mixture` of the datasets (each
  repeats in a new order when it runs out), packed rows of `seq_len`, `workers` processes.
- `packed_feed`: a pipeline batch as the arrays the model step reads (numpy, [B, L] / [B, S]).
- `padded_feeds`: the same batch's examples (its segments) one per row, longest first, in
  micro-batches of at most `slots` token slots whose rows are padded to a power of two from
  `min_width` (a micro-batch's longest): the padded baseline, example for example.
- `next_token_targets`: next-token targets and the mask of those the loss counts (inside a
  segment, and where a label column says so), the one builder both example models use;
  `make_batch`: examples/lm.py's batch (targets -100 where not counted); `model_batch`: a
  feed's; `counted_tokens`: the targets a pipeline batch's loss counts.
- `bucket`, `padded_rows`: the widths and rows of the padded baseline.
- `pipeline_rate`: the pipeline alone, drained without a model (batches/s, real tokens/s).

Worked example of `padded_feeds` (slots 8, min_width 2; a packed batch of two rows of 4 holding
segments of lengths [3, 1] and [2, 2]):

    sorted pieces   3  2  2  1
    micro-batch 1   width 4 (bucket of 3): 8 // 4 = 2 rows: [3 + pad, 2 + pad]
    micro-batch 2   width 2 (bucket of 2): 8 // 2 = 4 rows: [2, 1 + pad, empty, empty]
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator, Mapping

import grain
import jax
import jax.numpy as jnp
import numpy as np

from seqpack.packer import PackConfig
from seqpack.pipelines.datasets import (
    ArraySource,
    Batching,
    Mixture,
    Prefetch,
    make_training_pipeline,
)

FEED_KEYS = ("tokens", "segment_ids", "positions", "offsets", "lengths", "dataset_id")


def token_dtype(vocab: int) -> np.dtype:
    """The one token dtype of every corpus (and so of every row) for a model of `vocab` ids:
    uint16 where the ids fit, else int32. The rows take the dtype of the first example drawn,
    so corpora of different dtypes would give the run's rows (and compilations) whichever
    dataset came first, and ids past uint16 from one corpus would not fit another's."""
    return np.dtype(np.uint16 if vocab <= 1 << 16 else np.int32)


def load_corpus(path: str | pathlib.Path, vocab: int) -> ArraySource:
    """Examples `tokens[offsets[i]:offsets[i + 1]]` of an `.npz` corpus; ids >= vocab folded
    (id % vocab), so a smaller model vocabulary reads any corpus; `token_dtype(vocab)`."""
    with np.load(path) as z:
        tokens, offsets = z["tokens"], z["offsets"].astype(np.int64)
    if tokens.size and int(tokens.max()) >= vocab:
        tokens = tokens.astype(np.int64) % vocab
    return ArraySource({"tokens": (tokens.astype(token_dtype(vocab), copy=False), offsets)})


def smoke_corpora(vocab: int, *, examples: int = 400, seed: int = 0) -> dict[str, ArraySource]:
    """Two generated datasets a tiny model learns in a few steps: "count" (runs s, s+1, ...,
    8-48 tokens) and "motif" (a random 3-6 token motif repeated, 16-96 tokens)."""
    rng = np.random.default_rng(seed)
    count = [(rng.integers(vocab) + np.arange(rng.integers(8, 49))) % vocab
             for _ in range(examples)]
    motif = [np.resize(rng.integers(0, vocab, rng.integers(3, 7)), rng.integers(16, 97))
             for _ in range(examples)]
    return {name: _ragged_source(seqs, token_dtype(vocab))
            for name, seqs in (("count", count), ("motif", motif))}


def _ragged_source(seqs: list[np.ndarray], dtype: np.dtype) -> ArraySource:
    offsets = np.concatenate([[0], np.cumsum([s.size for s in seqs])]).astype(np.int64)
    return ArraySource({"tokens": (np.concatenate(seqs).astype(dtype), offsets)})


def pipeline(sources: Mapping[str, ArraySource], weights: Mapping[str, float], *,
             seq_len: int, batch_size: int, max_segments: int, seed: int = 0,
             workers: int = 0, worker_buffer: int = 2) -> grain.IterDataset:
    """Packed batches of a mixture of `sources` (shares of tokens = `weights`), forever."""
    mix = Mixture(dict(sources), weights=dict(weights), unit="tokens", on_exhausted="repeat",
                  seed=seed, num_epochs=None)
    return make_training_pipeline(
        mix, pack=PackConfig(seq_len, max_segments=max_segments, overflow="split"),
        batch=Batching(batch_size, shard_index=0, shard_count=1), shuffle_seed=seed,
        num_epochs=None,
        prefetch=Prefetch(worker_count=workers, worker_buffer_size=worker_buffer))


def real_tokens(batch: Mapping[str, np.ndarray]) -> int:
    """Tokens inside segments (the examples' own tokens, padding excluded)."""
    return int(np.asarray(batch["tokens_segment_lengths"]).sum())


def counted_tokens(batch: Mapping[str, np.ndarray]) -> int:
    """The loss's counted tokens: every segment's next-token targets (its length - 1)."""
    return int(np.maximum(np.asarray(batch["tokens_segment_lengths"]) - 1, 0).sum())


def next_token_targets(tokens, segment_ids, labels=None) -> tuple[jax.Array, jax.Array]:
    """(targets i32-like [B, L], counted bool [B, L]) of packed rows: the next token (0 past the
    row's end), counted where it is in the same segment (never across a segment boundary, never
    on padding) and, with `labels` [B, L] (SFT: -100 on the prompt), where its label is not -100."""
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    nxt = jnp.concatenate([segment_ids[:, 1:], jnp.zeros_like(segment_ids[:, :1])], axis=1)
    counted = (segment_ids > 0) & (nxt == segment_ids)
    if labels is not None:
        counted &= jnp.concatenate([labels[:, 1:], jnp.full_like(labels[:, :1], -100)],
                                   axis=1) != -100
    return targets, counted


def make_batch(tokens, segment_ids, positions, offsets, lengths) -> dict:
    """examples/lm.py's batch from packed rows (numpy or jax arrays, [B, L] and [B, S]):
    `next_token_targets`, -100 on every segment's last token and on padding."""
    targets, counted = next_token_targets(tokens, segment_ids)
    return {"tokens": jnp.asarray(tokens, jnp.int32),
            "targets": jnp.where(counted, targets.astype(jnp.int32), -100),
            "segment_ids": jnp.asarray(segment_ids, jnp.int32),
            "positions": jnp.asarray(positions, jnp.int32),
            "offsets": jnp.asarray(offsets, jnp.int32), "lengths": jnp.asarray(lengths, jnp.int32)}


def model_batch(feed: Mapping[str, np.ndarray]) -> dict:
    """`make_batch` of a feed (`packed_feed`'s or `padded_feeds`' arrays)."""
    return make_batch(*(feed[k] for k in FEED_KEYS[:5]))


def bucket(n: int, *, min_width: int, seq_len: int) -> int:
    """The padded width of a row holding n tokens: min_width * 2^k >= n, at most seq_len."""
    width = min_width
    while width < n:
        width *= 2
    return min(width, seq_len)


def padded_rows(pieces: list, rows: int, width: int, dtype=np.int32) -> dict[str, np.ndarray]:
    """`pieces` (1-D token arrays, each at most `width`) one a row in `rows` rows of `width`:
    make_batch's arrays (numpy), one segment slot a row; rows past the pieces hold none."""
    out = {"tokens": np.zeros((rows, width), dtype),
           "segment_ids": np.zeros((rows, width), np.int32),
           "positions": np.zeros((rows, width), np.int32),
           "offsets": np.full((rows, 1), width, np.int32),
           "lengths": np.zeros((rows, 1), np.int32)}
    for r, piece in enumerate(pieces):
        n = len(piece)
        out["tokens"][r, :n] = piece
        out["segment_ids"][r, :n], out["positions"][r, :n] = 1, np.arange(n)
        out["offsets"][r, 0], out["lengths"][r, 0] = 0, n
    return out


def packed_feed(batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The model step's arrays of a pipeline batch (`make_batch`'s inputs + dataset_id)."""
    return {"tokens": batch["tokens"], "segment_ids": batch["tokens_segment_ids"],
            "positions": batch["tokens_positions"], "offsets": batch["tokens_segment_offsets"],
            "lengths": batch["tokens_segment_lengths"],
            "dataset_id": batch["segment_dataset_id"]}


def padded_feeds(batch: Mapping[str, np.ndarray], *, slots: int, min_width: int
                 ) -> list[dict[str, np.ndarray]]:
    """The batch's segments one per row, longest first, in micro-batches of `slots // width`
    rows of `width` tokens (width: the bucket of the micro-batch's longest; empty rows fill
    the last one). Every micro-batch's arrays are `packed_feed`'s, one segment slot a row."""
    tokens = np.asarray(batch["tokens"])
    seq_len = tokens.shape[1]
    lengths = np.asarray(batch["tokens_segment_lengths"])
    offsets = np.asarray(batch["tokens_segment_offsets"])
    dataset = np.asarray(batch.get("segment_dataset_id", np.zeros_like(lengths)))
    rows, cols = np.nonzero(lengths)
    order = np.argsort(-lengths[rows, cols], kind="stable")
    pieces = [(int(rows[i]), int(cols[i])) for i in order]
    out = []
    while pieces:
        width = bucket(int(lengths[pieces[0]]), min_width=min(min_width, seq_len),
                          seq_len=seq_len)
        n_rows = max(1, slots // width)
        take, pieces = pieces[:n_rows], pieces[n_rows:]
        feed = padded_rows([tokens[row, offsets[row, col]:offsets[row, col] + lengths[row, col]]
                               for row, col in take], n_rows, width, tokens.dtype)
        feed["dataset_id"] = np.full((n_rows, 1), -1, np.int32)
        feed["dataset_id"][:len(take), 0] = [dataset[row, col] for row, col in take]
        out.append(feed)
    return out


def pipeline_rate(ds: grain.IterDataset, batches: int) -> dict[str, float]:
    """The pipeline alone: the first batch's wait (start-up), then `batches` more drained
    without a model: batches/s and real tokens/s."""
    it: Iterator = iter(ds)
    t0 = time.perf_counter()
    next(it)
    first = time.perf_counter() - t0
    t0, tokens = time.perf_counter(), 0
    for _ in range(batches):
        tokens += real_tokens(next(it))
    secs = time.perf_counter() - t0
    close = getattr(it, "close", None)
    if close is not None:
        close()
    return {"first_batch_s": first, "batches_per_s": batches / secs,
            "tokens_per_s": tokens / secs}
