"""The trainer's input pipeline: tfds array_record data sources, read by grain, split by process.

Each process reads only its own disjoint part of a split and yields
process-local numpy batches; ``Replicator.shard_batch`` / ``distribute`` then
assemble them into global arrays. TensorFlow is never needed: tfds writes and
reads array_record files, grain runs the batch pipeline.

* Training (``make_train_iterator``) is an endless, per-epoch reshuffled stream
  whose position can be saved and restored (``get_state`` / ``set_state``).
* Evaluation (``make_eval_iterator``) visits every example of a split exactly
  once across all processes. The last batches are padded and carry a ``mask``
  (False for padding), and every process yields the same number of batches,
  because SPMD processes must take every step together.

Both work a batch at a time, because per-example Python is what made loading
slow: a batch's shuffled indices come from NumPy, its records are read with one
call and decoded a feature at a time (`RecordSource`), and ``preprocess`` runs
once on the whole batch. A split that fits in memory is decoded once
(`CachedSource`, like tf.data's ``cache()``), by a background thread that
starts when the run opens its data, so the first epoch's decoding overlaps
compilation; later epochs are NumPy gathers. grain iterates over the batches
and can compute them on threads.

The data_dir may be a bucket: each machine reads a local copy of the dataset
(``remote``), and ``prepare_dataset`` puts an offline dataset into one.

Data of one's own needs no tfds builder (``user_sources``): a dataset named
``'module:function'`` is a function of the split's name that returns a
random-access source, and ``'array_record:PATTERN'`` names files written by
`write_array_records` (``array_records``). Both go through the same
iterators, so every guarantee above holds for them too.
"""

from replicator.trainer.data.array_records import ArrayRecordSource as ArrayRecordSource
from replicator.trainer.data.array_records import decode_example as decode_example
from replicator.trainer.data.array_records import encode_example as encode_example
from replicator.trainer.data.array_records import write_array_records as write_array_records
from replicator.trainer.data.cache import CachedSource as CachedSource
from replicator.trainer.data.iterators import TrainIterator as TrainIterator
from replicator.trainer.data.iterators import local_batch_size as local_batch_size
from replicator.trainer.data.iterators import make_eval_iterator as make_eval_iterator
from replicator.trainer.data.iterators import make_train_iterator as make_train_iterator
from replicator.trainer.data.iterators import num_eval_batches as num_eval_batches
from replicator.trainer.data.iterators import shard_bounds as shard_bounds
from replicator.trainer.data.records import RecordSource as RecordSource
from replicator.trainer.data.records import read_batch as read_batch
from replicator.trainer.data.sources import DatasetNotPreparedError as DatasetNotPreparedError
from replicator.trainer.data.sources import builds_here as builds_here
from replicator.trainer.data.sources import load_data_source as load_data_source
from replicator.trainer.data.sources import prepare_dataset as prepare_dataset
from replicator.trainer.data.sources import prepare_own as prepare_own
from replicator.trainer.data.sources import summary as summary
