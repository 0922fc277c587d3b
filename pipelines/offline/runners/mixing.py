"""A mixture's stream on Beam and Spark: `mixture.hashed`'s steps on the workers, so that no
example meets in one place (in the driver, or one worker, only each input's tally of a few KB
per hash bucket, each dataset's crossing bucket's examples, and one size per chunk)::

    MixTally    per input  (parallel)  its units per sample-hash bucket; summed per dataset
    Crossings   once                   the targets, each dataset's epochs and crossing bucket
    Members     per input  (parallel)  its examples in its dataset's crossing bucket
    MixPlan     once                   where each sample ends: the MixPlan and its record
    Picks       per input  (parallel)  its takes, each to the chunk its place falls in
    Chunks      per chunk  (parallel)  the chunk's stream (`hashed.chunk`)
    CutStream   per chunk  (parallel)  cut at the blocks' boundaries (`steps.cut_chunk`)

The stream and the plan are `hashed.select_inputs`'s, which the local runner runs in process.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from seqpack.pipelines.errors import one_line
from seqpack.pipelines.offline import steps
from seqpack.pipelines.offline.job import PackJob
from seqpack.pipelines.offline.mixture import MixSpec, hashed

Where = hashed.Places | None  # the inputs' places (None: an input failed to read)


def where_of(spec: MixSpec, files: Sequence[steps.FileSummary]) -> Where:
    """The inputs' `hashed.Places`, from every input's summary (in any order), made once for
    every step; None when one failed to read (`finish_plan` reports it)."""
    if any(f.error is not None for f in files):
        return None
    return hashed.places_of(spec, np.diff(steps.first_examples(files)).tolist())


def _item(scan: steps.FileScan, where: Where) -> hashed.Input | None:
    if where is None or scan.error is not None:
        return None
    return hashed.Input(*where.of(scan.index), scan.lengths, scan.loss_counts)


def tally(scan: steps.FileScan, spec: MixSpec, where: Where) -> list[tuple[int, np.ndarray]]:
    """(dataset, the input's tally); nothing when an input failed to read."""
    item = _item(scan, where)
    if item is None:
        return []
    assert where is not None
    return [(item.dataset, hashed.tally(spec, item, int(where.examples[item.dataset])))]


def add(tallies: Iterable[np.ndarray]) -> np.ndarray | None:
    """The sum of some tallies (a combiner's)."""
    present = [t for t in tallies if t is not None]
    return functools.reduce(np.add, present) if present else None


Crossed = tuple[float, list[hashed.Crossing]] | str | None


def crossings(tallies: Iterable[tuple[int, np.ndarray]], spec: MixSpec) -> Crossed:
    """`hashed.crossings` of every dataset's tally: None when an input failed to read, the
    error's message when the mixture is refused (a dataset repeated past `max_repetition`)."""
    by = dict(tallies)
    if len(by) < len(spec.datasets):
        return None
    try:
        return hashed.crossings(spec, [by[d] for d in range(len(by))])
    except ValueError as e:
        return one_line(e)


def members(scan: steps.FileScan, spec: MixSpec, where: Where, crossed: Crossed
            ) -> list[tuple[int, tuple[np.ndarray, np.ndarray]]]:
    """(dataset, the input's examples in its dataset's crossing bucket)."""
    item = _item(scan, where)
    if item is None or not isinstance(crossed, tuple):
        return []
    return [(item.dataset, hashed.members(spec, crossed[1][item.dataset], item))]


def plan(found: Iterable[tuple[int, tuple[np.ndarray, np.ndarray]]], spec: MixSpec,
         crossed: Crossed) -> hashed.MixPlan | str | None:
    """The MixPlan (or what `crossings` gave instead of crossings)."""
    if not isinstance(crossed, tuple):
        return crossed
    by: list[list] = [[] for _ in crossed[1]]
    for d, m in found:
        by[d].append(m)
    return hashed.plan(spec, crossed[0], crossed[1], by)


def picks(scan: steps.FileScan, spec: MixSpec, where: Where, mix: hashed.MixPlan | str | None,
          block_size: int) -> list[tuple[int, hashed.Picks]]:
    item = _item(scan, where)
    if item is None or not isinstance(mix, hashed.MixPlan):
        return []
    return hashed.picks(spec, mix, mix.chunks(block_size), item)


def chunk(element: tuple[int, Iterable[hashed.Picks]]) -> tuple[int, np.ndarray, np.ndarray]:
    g, found = element
    return (g, *hashed.chunk(list(found)))


def beam_plan(p: Any, scans: Any, spec: MixSpec, where: Any) -> Any:
    """The Beam stages up to the MixPlan, as a singleton side input (`where`: the inputs'
    `Where`, a side input)."""
    import apache_beam as beam

    tallies = (scans | "MixTally" >> beam.FlatMap(tally, spec, where)
               | "SumTallies" >> beam.CombinePerKey(add))
    crossed = beam.pvalue.AsSingleton(
        p | "MixOnce" >> beam.Create([None])
        | "Crossings" >> beam.Map(lambda _, t: crossings(t, spec), beam.pvalue.AsList(tallies)))
    return beam.pvalue.AsSingleton(
        scans | "Members" >> beam.FlatMap(members, spec, where, crossed)
        | "GatherMembers" >> beam.combiners.ToList()
        | "MixPlan" >> beam.Map(plan, spec, crossed))


def beam_stream(p: Any, scans: Any, gathered: Any, job: PackJob) -> tuple[Any, Any]:
    """The Beam stages above (`gathered`: every input's FileSummary, as one list): (the
    stream's (block, BlockSlice) pairs, the MixPlan as a singleton side input)."""
    import apache_beam as beam

    spec = job.mixture
    assert spec is not None
    where = beam.pvalue.AsSingleton(gathered | "Places" >> beam.Map(lambda f: where_of(spec, f)))
    mix = beam_plan(p, scans, spec, where)
    chunks = (scans | "Picks" >> beam.FlatMap(picks, spec, where, mix, job.block_size)
              | "GroupChunks" >> beam.GroupByKey() | "Chunks" >> beam.Map(chunk))
    sizes = beam.pvalue.AsList(chunks | "ChunkSizes" >> beam.Map(lambda c: (c[0], c[1].size)))
    cut = chunks | "CutStream" >> beam.FlatMap(steps.cut_chunk, sizes, job.block_size)
    return cut, mix


def spark_plan(scans: Any, spec: MixSpec, where: Where) -> hashed.MixPlan | str | None:
    """The Spark stages up to the MixPlan over the (index, FileScan) `scans`."""
    crossed = crossings(scans.flatMap(lambda s: tally(s[1], spec, where))
                        .reduceByKey(np.add).collect(), spec)
    return plan(scans.flatMap(lambda s: members(s[1], spec, where, crossed)).collect(), spec,
                crossed)


def spark_stream(scans: Any, files: Sequence[steps.FileSummary], job: PackJob,
                 by_key: Any) -> tuple[Any, int, hashed.MixPlan | str | None, Any]:
    """The Spark stages above over the persisted (index, FileScan) `scans`: (the stream's
    (block, BlockSlice) pairs, the number of blocks, the MixPlan, the persisted chunks to
    unpersist once the blocks are planned); `by_key`: `spark.by_key`."""
    spec = job.mixture
    assert spec is not None
    where = where_of(spec, files)
    mix = spark_plan(scans, spec, where)
    if not isinstance(mix, hashed.MixPlan):
        return scans.context.parallelize([]), 0, mix, None
    chunks = by_key(scans.flatMap(lambda s: picks(s[1], spec, where, mix, job.block_size)),
                    mix.chunks(job.block_size), lambda g, found: [chunk((g, found))]).persist()
    sizes = chunks.map(lambda c: (c[0], c[1].size)).collect()
    blocks = -(-sum(n for _, n in sizes) // job.block_size)
    cut = chunks.flatMap(lambda c: steps.cut_chunk(c, sizes, job.block_size))
    return cut, blocks, mix, chunks
