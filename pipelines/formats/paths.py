"""Input arguments as users hold them, turned into the list of input files read in that order.

    expand_inputs(["data/", "more/*.jsonl.gz", "gs://bucket/x/*.parquet", "a.parquet"])

- a local directory: its files whose name says a known format (`detect.format_by_name`:
  .jsonl / .ndjson / .json, .parquet, .arrow, .arrayrecord / .array_record and their shard
  names, .npz, .npy, a Megatron .bin with its .idx (one input), .txt, each also .gz / .zst),
  sorted by name. Hidden files (names starting with ".")
  are left out; every other file it leaves out (no known format by its name: ``_SUCCESS``,
  ``README.md``; a subdirectory, which is not read) is named in a warning on the ``seqpack``
  logger, with the reason. Text files beside token files (JSONL, Parquet, Arrow, ArrayRecord)
  are refused, naming the text file: their UTF-8 bytes would be packed beside the token ids;
  `input_format` says which to read (the others are then left out, named). A seqpack output
  directory (its manifest, intent, lock, spill or shards) is refused: it is not an input.
- an HF `datasets` `save_to_disk` directory (``state.json``, ``dataset_info.json`` and Arrow
  shards; locally or a URL prefix ending in "/"): its shards in ``state.json``'s order; a
  DatasetDict's directory (``dataset_dict.json``) is refused naming its splits.
- a local glob (``*``, ``?``, ``[...]``; ``**`` recursive) that is not itself an existing path:
  every file it matches, sorted, as a shell would give them (directories it matches are
  skipped, as URL globs skip them); InputError if nothing matches.
- a URL glob: the sorted objects it matches (`storage.expand`); a URL ending in "/": the
  objects under it of a known format by name, sorted.
- a Megatron dataset's prefix (``x`` for ``x.bin`` and ``x.idx``): its ``.bin``.
- anything else as it is (a missing file is named by the reader).

The same file given twice (the same path, or another name for it: ``./a``, a symlink, a hard
link; a URL spelled the same) is refused unless `allow_duplicates`: packing it twice is
rarely meant.

An input's identity lives here too: its `fingerprint` (size, sha256), the local file it is read
from (`local_input`), and the stamps a scan notes beside them (`STAMPS`; `unstamped`).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from seqpack.pipelines import storage
from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats import arrays
from seqpack.pipelines.formats.arrays import megatron_prefix
from seqpack.pipelines.formats.detect import format_by_name

OUTPUT_FILES = ("manifest.json", "pack_intent.json")  # formats.manifest's MANIFEST, INTENT
_OUTPUT_NAMES = re.compile(r"^(rows-\d+-of-\d+\.(arrayrecord|parquet|idx\.parquet).*|pack\.lock|"
                           r"spill\.tmp|"
                           r"manifest\.json|pack_intent\.json)$")  # what `seqpack pack` writes
_GLOB = re.compile(r"[*?[]")
_TOKEN_FORMATS = ("jsonl", "parquet", "arrow", "arrayrecord", "npz", "npy", "megatron")
log = logging.getLogger("seqpack")


def expand_inputs(args: Sequence[str | os.PathLike], *, allow_duplicates: bool = False,
                  input_format: str | None = None) -> list[str]:
    """The input files that `args` name, in order (see the module docstring); InputError for a
    directory or glob holding none, for a directory mixing text with token files unless
    `input_format` says which to read, and for a file given twice unless `allow_duplicates`."""
    out: list[str] = []
    for arg in args:
        path = os.fspath(arg)
        if storage.is_url(path):
            out.extend((hf_dataset_files(path) or _url_files(path, input_format))
                       if path.endswith("/") else storage.expand(path))
        elif os.path.isdir(path):
            out.extend(hf_dataset_files(path) or _directory_files(path, input_format))
        elif not os.path.exists(path) and _GLOB.search(path):
            out.extend(_glob_files(path))
        else:
            out.append(megatron_prefix(path))  # a Megatron dataset's prefix: its .bin
    out = _one_of_each_pair(out)
    if not allow_duplicates:
        check_distinct(out)
    return out


def _one_of_each_pair(paths: list[str]) -> list[str]:
    """`paths` without the ``.idx`` of each Megatron ``.bin`` among them (the pair is one
    input)."""
    held = {os.path.splitext(p)[0] for p in paths if p.lower().endswith(".bin")}
    return [p for p in paths if not (p.lower().endswith(".idx")
                                     and os.path.splitext(p)[0] in held)]


def is_output_dir(path: str) -> bool:
    """Whether `path` is a seqpack output (a directory or URL prefix holding its manifest or
    intent), which `stats`, `inspect` and `verify` read as a whole."""
    if storage.is_url(path):
        return format_by_name(path) is None and any(
            storage.exists(storage.join(path.rstrip("/"), n)) for n in OUTPUT_FILES)
    return os.path.isdir(path) and any(_OUTPUT_NAMES.match(n) for n in os.listdir(path))


HF_STATE, HF_INFO, HF_SPLITS = "state.json", "dataset_info.json", "dataset_dict.json"


def hf_dataset_files(path: str) -> list[str] | None:
    """The Arrow shards of an HF `datasets` `save_to_disk` directory (or URL prefix), in its
    ``state.json`` order; None when `path` is not one. InputError for a DatasetDict's
    directory (naming its splits) and for a ``state.json`` naming no plain file."""
    url = storage.is_url(path)
    root = path.rstrip("/") if url else path

    def join(name: str) -> str:
        return storage.join(root, name) if url else os.path.join(root, name)

    def read(name: str) -> Any:
        try:
            return json.loads(storage.read_bytes(join(name)) if url else
                              open(join(name), "rb").read())
        except (OSError, ValueError) as e:
            raise InputError(f"{join(name)}: not readable JSON ({e})") from None

    present = storage.exists if url else os.path.isfile
    if present(join(HF_SPLITS)):
        splits = list(read(HF_SPLITS).get("splits") or []) or ["train"]
        raise InputError(f"{path}: an HF DatasetDict (splits {splits}); pass one split's "
                         f"directory, e.g. {join(splits[0])}")
    if not (present(join(HF_STATE)) and present(join(HF_INFO))):
        return None
    names = [f.get("filename") for f in read(HF_STATE).get("_data_files") or []]
    if not names or not all(isinstance(n, str) and n == os.path.basename(n) and n
                            for n in names):
        raise InputError(f"{join(HF_STATE)}: _data_files {names} must name the dataset's Arrow "
                         "files in its directory")
    return [join(n) for n in names]


def check_distinct(paths: Sequence[str]) -> None:
    """InputError naming the first file that `paths` hold twice (under any name)."""
    seen: dict[object, str] = {}
    for path in paths:
        key = _identity(path)
        if key in seen:
            also = "" if seen[key] == path else f" (also given as {seen[key]})"
            raise InputError(f"{path}: given twice as an input{also}; each input is read once: "
                             "drop the repeat, or pass allow_duplicates=True to read it "
                             "again")
        seen[key] = path


def _identity(path: str) -> object:
    if storage.is_url(path):
        return ("url", path)
    try:
        st = os.stat(path)
    except OSError:
        return ("path", os.path.realpath(path))
    return ("file", st.st_dev, st.st_ino)


def _directory_files(path: str, input_format: str | None = None) -> list[str]:
    if is_output_dir(path):
        raise InputError(f"{path}: a seqpack output directory, not an input (read it with "
                         "seqpack stats / inspect / verify; pack its inputs)")
    names = sorted(n for n in os.listdir(path) if not n.startswith("."))
    entries = [os.path.join(path, n) for n in names]
    for e in entries:
        if not os.path.isfile(e):
            log.warning("%s: left out: a directory (subdirectories are not read; pass '%s')",
                        e, os.path.join(e, "*"))
    files = _choose(path, [e for e in entries if os.path.isfile(e)], input_format)
    if not files:
        hint = f"; subdirectories are not read: pass '{os.path.join(path, '*', '*')}'" \
            if any(os.path.isdir(e) for e in entries) else ""
        raise InputError(f"{path}: a directory with no input files (.jsonl, .parquet, .arrow, "
                         f".arrayrecord, .npz, .npy, .bin/.idx, .txt, also .gz / .zst){hint}")
    return files


def _choose(where: str, paths: list[str], input_format: str | None) -> list[str]:
    """The inputs among a listing's files (see the module docstring): those of a known format
    by name, the others named in a warning; text beside token files refused unless
    `input_format` says which to read."""
    formats = {p: format_by_name(p) for p in paths}
    listed = set(paths)
    for p in paths:  # a .bin beside its .idx: a Megatron dataset (by its .bin, one input)
        if p.lower().endswith(".bin") and os.path.splitext(p)[0] + ".idx" in listed:
            formats[p] = "megatron"
    for p, f in formats.items():
        if f is None:
            log.warning("%s: left out: no known input format by its name (.jsonl, .parquet, "
                        ".arrow, .arrayrecord, .npz, .npy, .bin/.idx, .txt, also .gz / .zst)", p)
    files = [p for p, f in formats.items() if f is not None]
    text = [p for p in files if formats[p] == "text"]
    tokens = [p for p in files if formats[p] in _TOKEN_FORMATS]
    if not (text and tokens):
        return files
    if input_format is None:
        check_text_beside_tokens([(p, str(formats[p])) for p in files], where=f" in {where}",
                                 hint="pass input_format= to say which files to read")
    for p in files:
        if formats[p] != input_format:
            log.warning("%s: left out: not of input_format=%r", p, input_format)
    return [p for p in files if formats[p] == input_format]


def check_text_beside_tokens(formats: Sequence[tuple[str, str]], *, where: str = "",
                             hint: str = "pack it in a run of its own",
                             tokenized: bool = False) -> None:
    """InputError naming the first text input when `formats` ((path, format) of every input,
    by name or content) holds both text and token files: its UTF-8 bytes would be packed as
    ids 0..255 beside the token ids (`tokenized`: a tokenizer reads every input, no check)."""
    text = [p for p, f in formats if f == "text" and not tokenized]
    kinds = sorted({f for _, f in formats if f in _TOKEN_FORMATS})
    if text and kinds:
        count = sum(f in _TOKEN_FORMATS for _, f in formats)
        raise InputError(f"{text[0]}: a text file among {count} token file(s) "
                         f"({', '.join(kinds)}){where}: its UTF-8 bytes would be packed beside "
                         f"the token ids; move it out, or {hint}")


def _glob_files(pattern: str) -> list[str]:
    files = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not files:
        raise InputError(f"{pattern}: no files match")
    return files


def _url_files(prefix: str, input_format: str | None = None) -> list[str]:
    listing = [u for u in storage.glob(prefix + "*") if not u.rsplit("/", 1)[-1][:1] == "."]
    files = _choose(prefix, listing, input_format)
    if not files:
        raise InputError(f"{prefix}: no objects of a known input format under it (.jsonl, "
                         ".parquet, .arrow, .arrayrecord, .npz, .npy, .bin/.idx, .txt, also "
                         ".gz / .zst)")
    return files


# -- an input's identity: its fingerprint and stamps (see formats.inputs) ----------------------


def lengths_sha256(lengths: np.ndarray) -> str:
    """sha256 of example lengths as little-endian int64: one input's entry in the manifest."""
    return hashlib.sha256(np.ascontiguousarray(lengths, "<i8").tobytes()).hexdigest()


def combined_lengths_sha256(files: Sequence[dict]) -> str:
    """The manifest's digest of every example length, from each input's `lengths_sha256` (in
    input order): computed input by input, so no step needs every length."""
    return hashlib.sha256("".join(f["lengths_sha256"] for f in files).encode()).hexdigest()


def fingerprint(path: str) -> dict:
    """{"path", "size", "sha256"} of a file or an object (the contract: `formats.inputs`)."""
    with local_input(path) as local:
        with open(local, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
            size = f.tell()
    return {"path": fingerprint_path(path), "size": size, "sha256": digest}


@contextlib.contextmanager
def local_input(path: str, fmt: str | None = None) -> Iterator[str]:
    """A local file to read `path` from: the path itself, or a URL's temporary download
    (removed on exit; a Megatron dataset's, `fmt` "megatron", beside its other file).
    InputError if it is missing; an InputError raised while reading the download names the URL,
    not the temporary file."""
    if not storage.is_url(path):
        if not os.path.isfile(path):
            what = "a directory; pass its files" if os.path.isdir(path) else "no such file"
            raise InputError(f"{path}: {what}")
        yield path
        return
    if (fmt or format_by_name(path)) == "megatron":  # the pair, side by side
        with storage.local_copies(arrays.megatron_pair(path)) as pair, \
                storage.named(os.path.dirname(pair[0]), path.rsplit("/", 1)[0]):
            yield pair[os.path.splitext(path)[1].lower() == ".idx"]
        return
    with storage.local_copy(path) as local, storage.named(local, path):
        yield local


def file_stamp(path: str) -> tuple[int, int]:
    """(size, modification stamp in ns) of a local file."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


STAMPS = ("mtime_ns", "version")  # a file's modification stamp, an object's version


def entry_files(entry: Any) -> list[Any]:
    """An input's entry and, for a Megatron pair, its other file's (`companion`)."""
    return [entry, entry["companion"]] if "companion" in entry else [entry]


def unstamped(entry: Mapping[str, Any]) -> dict:
    """An input's entry without its stamps (`STAMPS`, its companion's too): what names its
    content (a file touched, not changed, is the same input)."""
    out = {k: v for k, v in entry.items() if k not in STAMPS}
    if "companion" in out:
        out["companion"] = unstamped(out["companion"])
    return out


def fingerprint_path(path: str) -> str:
    """The `path` of an input's manifest entry: its absolute path, or its URL."""
    return path if storage.is_url(path) else os.path.abspath(path)
