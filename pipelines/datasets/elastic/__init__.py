"""Online packing that restores on any number of hosts and worker processes: state is references.

- `streams`: the positions of a seeded global order each consumer (a host's worker) reads, and
  how the positions a layout left are pooled and dealt to another.
- `examples`: `ElasticExamples`, a random-access source read in that order.
- `refs`: the examples a packer holds, as (dataset, index) references (`RefTable`).
- `flight`: the pieces a packer holds in flight, named by reference, dealt out by example.
- `restore`: fetching referenced examples again (no replay), and planning pieces again.
- `merge`: the restore state of a layout's packer states, and each new consumer's share.
- `hosts`: `OnlineHosts`, the top of the pipeline: states stamped with their layout, and
  restored from every host's state on another layout.
- `checkpoint`: every host's state from Orbax's Grain checkpoint files
  (`read_host_states`, `ElasticCheckpointHandler`).
"""

from seqpack.pipelines.datasets.elastic import restore
from seqpack.pipelines.datasets.elastic.checkpoint import (
    ElasticCheckpointHandler,
    read_host_states,
)
from seqpack.pipelines.datasets.elastic.examples import (
    ElasticExamples,
    GlobalOrder,
    consumer_of,
    global_order,
)
from seqpack.pipelines.datasets.elastic.flight import deferred_flight, encode_table
from seqpack.pipelines.datasets.elastic.hosts import OnlineHosts, grain_worker_states
from seqpack.pipelines.datasets.elastic.merge import ELASTIC, index_in, share
from seqpack.pipelines.datasets.elastic.refs import Refs, RefTable, decode_refs
from seqpack.pipelines.datasets.elastic.streams import Stream

__all__ = ["ELASTIC", "ElasticCheckpointHandler", "ElasticExamples", "GlobalOrder", "OnlineHosts",
           "RefTable", "Refs", "Stream", "consumer_of", "decode_refs", "deferred_flight",
           "encode_table", "global_order", "grain_worker_states", "index_in", "read_host_states",
           "restore", "share"]
