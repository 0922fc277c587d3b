"""Length corpora for the packer and balance benchmarks: the shared real ones, plus two built here.

- `chat_dev`, `gsm8k_train` (and `chat_sft_dev`): ../shared/data/*.npz (see its README).
- `stdlib_source`: a long-document corpus: every .py file of this Python's standard library
  (site-packages left out, sorted by path), whitespace-tokenized: 1,790 files, 2.77M tokens,
  median 591, max 76,636 (Python 3.11.7).
- `chat_turns`: a short-dialogue-turn corpus for the cap-binding case: chat_dev cut into turns
  at sentence ends ('.', '?', '!', [SEP]), each sentence end closing a turn with probability
  0.42 (seeded): ~277k turns, mean ~42 tokens.

Only lengths are built for the derived corpora (what planning needs); `tokens_of` gives token
arrays of the right lengths when a benchmark needs rows (the ids are the positions mod 30,000).
"""

from __future__ import annotations

import pathlib
import sysconfig

import numpy as np

from benchmarks.common import DATA

_SENTENCE_ENDS = (1012, 1029, 999, 102)  # WordPiece ids of '.', '?', '!', [SEP]


def _npz(name: str) -> tuple[np.ndarray, np.ndarray] | None:
    path = DATA / f"{name}.npz"
    if not path.is_file():
        return None
    z = np.load(path)
    return z["tokens"], z["offsets"].astype(np.int64)


def stdlib_source() -> np.ndarray:
    """Lengths (whitespace tokens) of the standard library's .py files."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    return np.array([len(p.read_bytes().split()) for p in files], np.int64)


def chat_turns() -> np.ndarray | None:
    """Lengths of chat_dev cut into dialogue turns (see the module docstring)."""
    got = _npz("chat_dev")
    if got is None:
        return None
    tokens, offsets = got
    ends = np.flatnonzero(np.isin(tokens, _SENTENCE_ENDS)) + 1
    keep = ends[np.random.default_rng(0).random(ends.size) < 0.42]
    lengths = np.diff(np.union1d(keep, offsets))
    return lengths[lengths > 0]


def small_lognormal(seed: int, L: int, mu: tuple[float, float]) -> tuple[float, float, np.ndarray]:
    """(mu, sigma, lengths) of a seeded small corpus: 500 to 3,000 lognormal lengths, mu drawn
    in `mu`, sigma in [0.3, 1], clipped to [1, L] (`--synthetic --small`, and the tests' seeded
    corpora)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(500, 3000))
    m, sigma = rng.uniform(*mu), rng.uniform(0.3, 1.0)
    return m, sigma, np.clip(rng.lognormal(m, sigma, n).astype(np.int64), 1, L)


def lengths(names: list[str] | None = None) -> dict[str, np.ndarray]:
    """{name: lengths i64[n]} of the corpora asked for (default: all that are available)."""
    out: dict[str, np.ndarray] = {}
    for name in names or ["chat_dev", "gsm8k_train", "stdlib_source", "chat_turns"]:
        if name == "stdlib_source":
            out[name] = stdlib_source()
        elif name == "chat_turns":
            got = chat_turns()
            if got is not None:
                out[name] = got
        else:
            z = _npz(name)
            if z is not None:
                out[name] = np.diff(z[1])
    if not out:  # no shared data: the synthetic corpus of benchmarks.common
        rng = np.random.default_rng(0)
        out["synthetic_lognormal"] = np.clip(rng.lognormal(5.6, 0.7, 30_000).astype(np.int64),
                                             1, 9_000)
    return out


def tokens_of(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, offsets) with these lengths; ids are positions mod 30,000 (uint16)."""
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return (np.arange(offsets[-1]) % 30_000).astype(np.uint16), offsets
