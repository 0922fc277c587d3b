"""The manifest of a packed directory: one typed object, one reader, one writer.

A packed directory (``seqpack pack``, the Beam job) holds ArrayRecord shards and, written last,
``manifest.json``; while a run is incomplete it holds ``pack_intent.json`` instead: the same
object without its results (`shard_num_rows`, `stats`, `example_length_histogram`). Example::

    {"format": "seqpack-rows", "version": 1, "record_encoding": "SQP1",
     "feature": "tokens", "seq_len": 2048, "max_segments": 64,
     "config": {...PackConfig...}, "inputs": {...read options, fingerprints, counts...},
     "writer_options": "group_size:1,uncompressed", "stored_keys": ["tokens", ...],
     "shard_rows": 1024, "num_rows": 5695,
     "shards": ["rows-00000-of-00006.arrayrecord", ...], "plan_block_size": 4194304,
     "shard_num_rows": [1024, ...], "stats": {...}, "example_length_histogram": {...}}

JSON is written to a temporary name and renamed, so a reader never sees half a file; the bytes
depend only on the content (no timestamps), so a resumed run writes the same manifest.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from seqpack.packer import PackConfig
from seqpack.packer.plan import DEFAULT_BLOCK_SIZE
from seqpack.pipelines.errors import InputError

FORMAT = "seqpack-rows"
VERSION = 1
RECORD_ENCODING = "SQP1"
MANIFEST = "manifest.json"
INTENT = "pack_intent.json"
_RESULTS = ("shard_num_rows", "stats", "example_length_histogram")


def shard_names(num_rows: int, shard_rows: int) -> list[str]:
    n = -(-num_rows // shard_rows)
    return [f"rows-{i:05d}-of-{n:05d}.arrayrecord" for i in range(n)]


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

    @property
    def complete(self) -> bool:
        return self.shard_num_rows is not None

    @property
    def feature(self) -> str:
        return str(self.config["feature"])

    @property
    def seq_len(self) -> int:
        return int(self.config["seq_len"])

    @property
    def max_segments(self) -> int:
        return int(self.config["max_segments"])

    def pack_config(self) -> PackConfig:
        return PackConfig(**self.config)

    def intent(self) -> Manifest:
        """This manifest without its results (what ``pack_intent.json`` holds)."""
        return dataclasses.replace(self, shard_num_rows=None, stats=None,
                                   example_length_histogram=None)

    def completed(self, shard_num_rows: list[int], results: dict[str, Any]) -> Manifest:
        """The complete manifest: row counts per shard plus `stats` and the length histogram."""
        return dataclasses.replace(self, shard_num_rows=list(shard_num_rows), **results)

    def to_json(self) -> dict[str, Any]:
        """The JSON object (plain types, fixed key order)."""
        obj: dict[str, Any] = {
            "format": FORMAT, "version": VERSION, "record_encoding": RECORD_ENCODING,
            "feature": self.feature, "seq_len": self.seq_len, "max_segments": self.max_segments,
        }
        obj.update((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        if not self.complete:
            for key in _RESULTS:
                del obj[key]
        return json.loads(json.dumps(obj))

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
            missing = [k for k, v in fields.items() if v is None and k not in _RESULTS]
            if missing:
                raise ValueError(f"missing {missing}")
            manifest = cls(**fields)
            manifest.pack_config()
            shards = manifest.shards
            if not isinstance(shards, list) or not all(isinstance(s, str) for s in shards):
                raise ValueError("'shards' must be a list of file names")
            rows = manifest.shard_num_rows
            if rows is not None and len(rows) != len(shards):
                raise ValueError(f"{len(shards)} shards but {len(rows)} row counts")
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"{where}: not a seqpack manifest ({e})") from None
        return manifest


def read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise InputError(f"{path}: not a seqpack manifest (not valid JSON: {e})") from None


def write_json(path: str, obj: dict[str, Any]) -> None:
    """Writes `obj` to `path` atomically (temporary name, then rename)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """The complete manifest of a packed directory; InputError if there is none."""
    directory = os.fspath(directory)
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise InputError(f"{directory}: no such directory")
    if not os.path.isfile(path):
        raise InputError(f"{path}: missing; the directory is not a complete `seqpack pack` output "
                         "(an interrupted run? finish it with `seqpack pack ... --resume`)")
    manifest = Manifest.from_json(read_json(path), path)
    if not manifest.complete:
        raise InputError(f"{path}: not a seqpack manifest (no shard_num_rows)")
    return manifest


def read_record(path: str) -> Manifest:
    """A manifest or an intent file, as it is."""
    return Manifest.from_json(read_json(path), path)


def write_manifest(directory: str, manifest: Manifest) -> None:
    """Writes ``manifest.json`` (complete) or ``pack_intent.json`` (an intent)."""
    name = MANIFEST if manifest.complete else INTENT
    write_json(os.path.join(directory, name), manifest.to_json())


def check_unique_shards(manifest: Manifest, where: str) -> None:
    """InputError if the manifest lists a shard more than once (its rows would be read twice)."""
    seen: set[str] = set()
    for name in manifest.shards:
        if name in seen:
            raise InputError(f"{where}: not a seqpack manifest (shard {name!r} is listed twice)")
        seen.add(name)
