"""`--format parquet`: the row contract as Parquet, one Parquet row per packed row.

Every contract key and every extra column is a list column, padded as the contract pads it, so
any Parquet reader (pyarrow, pandas, HF `datasets`, DuckDB, Spark) sees the rows `seqpack
inspect` shows. Worked example (L = 8, S = 4, feature ``input_ids``, one extra column ``labels``),
one Parquet row::

    input_ids                    [7, 8, 9, 5, 6, 0, 0, 0]
    input_ids_segment_ids        [1, 1, 1, 2, 2, 0, 0, 0]
    input_ids_positions          [0, 1, 2, 0, 1, 0, 0, 0]
    input_ids_segment_lengths    [3, 2, 0, 0]
    input_ids_segment_offsets    [0, 3, 5, 5]
    segment_source_index         [12, 40, -1, -1]
    segment_source_start         [0, 0, 0, 0]
    labels                       [-100, 8, 9, -100, 6, -100, -100, -100]

    import pyarrow.parquet as pq
    rows = pq.read_table("packed/rows-00000-of-00004.parquet")      # no seqpack needed
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from seqpack.pipelines.formats.encodings import arrow
from seqpack.pipelines.formats.encodings.base import Layout


class ParquetRows(arrow.ParquetEncoding):
    name, suffix, record_encoding = "parquet", ".parquet", "parquet-rows"

    def stored_keys(self, layout: Layout) -> list[str]:
        return list(layout.config.keys().roles().values()) + layout.sources()[2:] + \
            layout.names()

    def write(self, path: str, batch: Mapping[str, np.ndarray], layout: Layout) -> None:
        columns = {name: arrow.padded(np.asarray(batch[name]))
                   for name in self.stored_keys(layout)}
        arrow.write_parquet(path, columns, layout, dictionary=layout.config.keys().derived)

    def decoder(self, layout: Layout) -> arrow.Decode:
        config = layout.config
        k = config.keys()
        widths = {name: config.seq_len for name in (*k.per_token, *layout.names())}
        widths.update((name, config.max_segments) for name in (*k.per_slot,
                                                              *layout.sources()))

        def decode(table: Any, path: str, first: int) -> dict[str, np.ndarray]:
            return {name: arrow.square(table, name, widths[name], path, first)
                    for name in self.stored_keys(layout)}

        return decode

