"""Per-replica values: one row per replica, stacked on a leading axis.

`Replicator.run` returns an output that differs between replicas stacked,
``[num_replicas, ...]`` (pmap's convention, tf.distribute's ``PerReplica``).
Passed back into ``run``, each replica receives its own row with the shape it
had inside the step, so per-device state (BatchNorm statistics without an
``axis_name``, EMAs, counters, per-device keys) round-trips unchanged.

A stacked value and a batch look alike: both are split over the replicas on
axis 0. ``run`` tells them apart by where a value came from: it remembers the
arrays it returned as per-replica (and the batches `shard_batch` made), and
everything else must say what it is. `PerReplica` marks a value built
elsewhere (on the host, restored, or computed from a run output outside
``run``); a value that cannot be told apart is an error that says so.

The marker and the registry of roles live in `replicator.parallel.placement`, with the
other roles an argument can play; these names stay importable from here.
"""

from replicator.parallel.placement import Kind as Kind
from replicator.parallel.placement import PerReplica as PerReplica
from replicator.parallel.placement import is_per_replica as is_per_replica
from replicator.parallel.placement import known_kind as known_kind
from replicator.parallel.placement import mark_like as mark_like
from replicator.parallel.placement import remember as remember
