"""The manifest of a packed directory: one typed object, one reader, one writer.

A packed directory (``seqpack pack``, the Beam job) holds shards (ArrayRecord, or Parquet for the
other `--format`s: ``encoding`` names it, absent for ArrayRecord) and, written last,
``manifest.json``; while a run is incomplete it holds ``pack_intent.json`` instead: the same
object without its results (`shard_num_rows`, `stats`, `example_length_histogram`). Example::

    {"format": "seqpack-rows", "version": 1, "record_encoding": "SQP1",
     "feature": "tokens", "seq_len": 2048, "max_segments": 64,
     "config": {...PackConfig...}, "inputs": {...read options, fingerprints, counts...},
     "writer_options": "group_size:1,uncompressed", "stored_keys": ["tokens", ...],
     "shard_rows": 1024, "num_rows": 5695,
     "shards": ["rows-00000-of-00006.arrayrecord", ...], "plan_block_size": 4194304,
     "shard_num_rows": [1024, ...], "stats": {...}, "example_length_histogram": {...},
     "shard_bytes": [8421376, ...], "shard_sha256": ["9f2c...", ...],
     "shapes": {"max_row_segments": 31, "longest_segment": 2048, "shortest_row": 1790,
                "min_row_next_tokens": 1771, "loss_tokens": 10580331},
     "manifest_sha256": "51ab..."}

(`shapes`: what trainers size static shapes by; `encoding`, after `columns`, only for the
Parquet formats: "parquet", "hf", "megatron"; `mixture`, last, only for `seqpack pack --mix`.)

Integrity: a complete manifest records each shard's size and sha256, and `manifest_sha256`, the
sha256 of its own JSON without that key (compact, keys in the order above); `read_manifest`
refuses a manifest that does not match itself, lists a shard twice or names a shard outside
the directory (a path, `..`, a URL), or whose shards are missing or of another size; `verify`
and `seqpack pack --resume` also re-hash every shard.

JSON is written to a temporary name and renamed, so a reader never sees half a file; the bytes
depend only on the content (no timestamps), so a resumed run writes the same manifest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

from seqpack.packer import PackConfig
from seqpack.packer.plan import DEFAULT_BLOCK_SIZE
from seqpack.pipelines import storage
from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats.encodings import encoding

FORMAT = "seqpack-rows"
VERSION = 1
RECORD_ENCODING = "SQP1"
MANIFEST = "manifest.json"
INTENT = "pack_intent.json"
_RESULTS = ("shard_num_rows", "stats", "example_length_histogram", "shard_bytes",
            "shard_sha256", "shapes")
SELF_DIGEST = "manifest_sha256"
# None in outputs written before they existed; `encoding` and `shapes` are left out of the
# JSON when None (an ArrayRecord output's intent reads as it did before formats existed)
_OPTIONAL = ("row_order", "columns", "encoding", "shapes", "mixture")
_OMITTED_IF_NONE = ("encoding", "shapes", "mixture")


def shard_names(num_rows: int, shard_rows: int, suffix: str = ".arrayrecord") -> list[str]:
    n = -(-num_rows // shard_rows)
    return [f"rows-{i:05d}-of-{n:05d}{suffix}" for i in range(n)]


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a packing run writes (an intent) and, once complete, what it wrote."""

    config: dict[str, Any]  # PackConfig.to_dict()
    inputs: dict[str, Any]  # read options, tokenizer, per-file fingerprints, counts, digest
    writer_options: str  # ArrayRecord writer options
    stored_keys: list[str]  # the arrays each record holds
    shard_rows: int
    num_rows: int
    shards: list[str]  # shard file names, relative to the directory
    plan_block_size: int = DEFAULT_BLOCK_SIZE  # examples planned together (`packer.plan_rows`)
    shard_num_rows: list[int] | None = None  # None until the run is complete
    stats: dict[str, Any] | None = None  # PackingStats.to_dict()
    example_length_histogram: dict[str, Any] | None = None
    shard_bytes: list[int] | None = None  # size of each shard file
    shard_sha256: list[str] | None = None  # sha256 of each shard file
    # How the plan's rows were put in order (`packer.order`): {"mode": "plan" | "shuffle" |
    # "balanced", "seed", "data_parallel", "batch_size", "cost_model"}; None: the plan's order
    # (outputs written before row orders existed).
    row_order: dict[str, Any] | None = None
    # Columns packed with the token feature under its segment layout, in order: [{"name": key
    # in the rows, "source": field/column read, "dtype": numpy dtype.str, "pad": int}]; None:
    # the token feature alone.
    columns: list[dict[str, Any]] | None = None
    # The shards' encoding (`formats.encodings`, `seqpack pack --format`): "parquet", "hf",
    # "megatron"; None: ArrayRecord files of SQP1 records.
    encoding: str | None = None
    # What a trainer sizes static shapes by (a result): max_row_segments, longest_segment,
    # shortest_row, min_row_next_tokens (a row's tokens less its segments), loss_tokens.
    shapes: dict[str, Any] | None = None
    # A mixture's spec and what each dataset gave (`offline.mixture`: unit, seed, selection,
    # and per dataset name, inputs, weight, units, tokens, examples, repetitions, first
    # example, sample_below); None: no mixture. Its rows carry `segment_dataset_id`.
    mixture: dict[str, Any] | None = None

    @property
    def complete(self) -> bool:
        return self.shard_num_rows is not None

    @property
    def record_encoding(self) -> str:
        return encoding(self.encoding).record_encoding if self.encoding else RECORD_ENCODING

    @property
    def feature(self) -> str:
        return str(self.config["feature"])

    @property
    def seq_len(self) -> int:
        return int(self.config["seq_len"])

    @property
    def max_segments(self) -> int:
        return int(self.config["max_segments"])

    @property
    def context_parallel(self) -> int | None:
        """C of `PackConfig(context_parallel=C)` (config["context_parallel"]), None without."""
        c = self.config.get("context_parallel")
        return None if c is None else int(c)

    def pack_config(self) -> PackConfig:
        return PackConfig(**self.config)

    def intent(self) -> Manifest:
        """This manifest without its results (what ``pack_intent.json`` holds)."""
        return dataclasses.replace(self, shard_num_rows=None, stats=None,
                                   example_length_histogram=None, shapes=None)

    def completed(self, shard_num_rows: list[int], results: dict[str, Any],
                  digests: list[tuple[int, str]]) -> Manifest:
        """The complete manifest: row counts per shard, `stats`, the length histogram and each
        shard's (size, sha256)."""
        return dataclasses.replace(self, shard_num_rows=list(shard_num_rows),
                                   shard_bytes=[int(b) for b, _ in digests],
                                   shard_sha256=[h for _, h in digests], **results)

    def to_json(self) -> dict[str, Any]:
        """The JSON object (plain types, fixed key order)."""
        obj: dict[str, Any] = {
            "format": FORMAT, "version": VERSION, "record_encoding": self.record_encoding,
            "feature": self.feature, "seq_len": self.seq_len, "max_segments": self.max_segments,
        }
        obj.update((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        if not self.complete:
            for key in _RESULTS:
                del obj[key]
        for key in _OMITTED_IF_NONE:
            if obj.get(key, 0) is None:
                del obj[key]
        obj = json.loads(json.dumps(obj))
        if self.complete:
            obj[SELF_DIGEST] = _self_digest(obj)
        return obj

    @classmethod
    def from_json(cls, obj: Any, where: str) -> Manifest:
        """Checks and loads a manifest / intent object; InputError naming `where` if invalid."""
        try:
            if not isinstance(obj, dict):
                raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
            if obj.get("format") != FORMAT:
                raise ValueError(f"format is {obj.get('format')!r}, not {FORMAT!r}")
            fields: dict[str, Any] = {f.name: obj.get(f.name) for f in dataclasses.fields(cls)}
            if fields["plan_block_size"] is None:  # written before blocks existed
                fields["plan_block_size"] = DEFAULT_BLOCK_SIZE
            missing = [k for k, v in fields.items() if v is None and k not in _RESULTS
                       and k not in _OPTIONAL]
            if missing:
                raise ValueError(f"missing {missing}")
            manifest = cls(**fields)
            manifest.pack_config()
            manifest.record_encoding  # noqa: B018 - a ValueError for an unknown encoding
            shards = manifest.shards
            if not isinstance(shards, list) or not all(isinstance(s, str) for s in shards):
                raise ValueError("'shards' must be a list of file names")
            for name in shards:
                check_shard_name(name)
            if len(set(shards)) != len(shards):
                twice = next(n for n in shards if shards.count(n) > 1)
                raise ValueError(f"shard {twice!r} is listed twice")
            if manifest.complete:
                for key in ("shard_num_rows", "shard_bytes", "shard_sha256"):
                    got = getattr(manifest, key)
                    if not isinstance(got, list) or len(got) != len(shards):
                        raise ValueError(f"{len(shards)} shards but {key} is {str(got)[:40]}")
                recorded = obj.get(SELF_DIGEST)
                body = {k: v for k, v in obj.items() if k != SELF_DIGEST}
                if recorded != _self_digest(body):
                    raise ValueError(f"{SELF_DIGEST} does not match its content (the file was "
                                     "edited or damaged)" if recorded else f"no {SELF_DIGEST}")
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"{where}: not a seqpack manifest ({e})") from None
        return manifest


def _self_digest(obj: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, separators=(",", ":")).encode()).hexdigest()


def signed(obj: dict[str, Any]) -> dict[str, Any]:
    """A manifest JSON object with its `manifest_sha256` (re)computed: for tools (and tests)
    that edit a manifest on purpose."""
    body = {k: v for k, v in obj.items() if k != SELF_DIGEST}
    return {**body, SELF_DIGEST: _self_digest(body)}


def check_shard_name(name: str) -> None:
    """ValueError unless `name` is a plain file name inside the directory (no path, no `..`,
    no URL, nothing hidden)."""
    if not name or name != os.path.basename(name) or "/" in name or "\\" in name \
            or ":" in name or name.startswith(".") or name in (MANIFEST, INTENT):
        raise ValueError(f"shard name {name!r} is not a file name inside the directory")


def file_digest(path: str) -> tuple[int, str]:
    """(size, sha256) of a file."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        return f.tell(), digest


def check_shard_files(directory: str, manifest: Manifest) -> None:
    """InputError unless every shard exists with the size the manifest records (a directory,
    or a URL prefix: one listing)."""
    listed = storage.sizes(directory) if storage.is_url(directory) else None
    for name, size in zip(manifest.shards, manifest.shard_bytes or []):
        path = storage.join(directory, name)
        try:
            got = os.path.getsize(path) if listed is None else listed[name]
        except (OSError, KeyError):
            raise InputError(f"{path}: missing; the manifest lists it (rerun `seqpack pack ... "
                             "--resume` to restore it)") from None
        if got != size:
            raise InputError(f"{path}: {got} bytes, the manifest says {size}; the shard is "
                             "damaged or replaced (rerun `seqpack pack ... --resume` to rewrite "
                             "it)")


def read_json(path: str) -> Any:
    """A JSON file or object (URL)."""
    try:
        return json.loads(storage.read_bytes(path))
    except ValueError as e:
        raise InputError(f"{path}: not a seqpack manifest (not valid JSON: {e})") from None


def write_json(path: str, obj: dict[str, Any]) -> None:
    """Writes `obj` to `path` atomically (temporary name, then rename)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def read_manifest(directory: str | os.PathLike, *, check_shards: bool = True) -> Manifest:
    """The complete manifest of a packed directory (or URL prefix: gs://bucket/packed/);
    InputError if there is none, it does not match itself, or (`check_shards`) a shard is
    missing or of another size."""
    directory = os.fspath(directory)
    path = storage.join(directory, MANIFEST)
    if not storage.is_url(directory) and not os.path.isdir(directory):
        raise InputError(f"{directory}: no such directory")
    if not storage.exists(path):
        raise InputError(f"{path}: missing; the directory is not a complete `seqpack pack` output "
                         "(an interrupted run? finish it with `seqpack pack ... --resume`)")
    manifest = Manifest.from_json(read_json(path), path)
    if not manifest.complete:
        raise InputError(f"{path}: not a seqpack manifest (no shard_num_rows)")
    if check_shards:
        check_shard_files(directory, manifest)
    return manifest


def read_record(path: str) -> Manifest:
    """A manifest or an intent file, as it is."""
    return Manifest.from_json(read_json(path), path)


def write_manifest(directory: str, manifest: Manifest) -> None:
    """Writes ``manifest.json`` (complete) or ``pack_intent.json`` (an intent)."""
    name = MANIFEST if manifest.complete else INTENT
    write_json(os.path.join(directory, name), manifest.to_json())
