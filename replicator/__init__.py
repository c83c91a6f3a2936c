"""replicator: TF-Replicator's programming model on modern JAX.

Write a step function as if for one device; `Replicator.run` (per replica, on
`jax.shard_map`) or `Replicator.compile` (global view, `jax.jit` over a mesh)
runs it on every device.
"""

from replicator import attention as attention  # rp.attention.causal_attention, per backend
from replicator import ema as ema  # rp.ema.track: an EMA of the parameters
from replicator import moe as moe  # rp.moe.moe_layer: experts over the "expert" axis
from replicator import offload as offload  # rp.offload: state in host memory between steps
from replicator import remat as remat  # rp.remat.checkpoint_policy: MaxText's named policies
from replicator import topology as topology  # rp.topology.devices: a TPU slice to compile for
from replicator.checkpoint import Checkpoints as Checkpoints
from replicator.context import AxisNameError as AxisNameError
from replicator.context import ReplicaContext as ReplicaContext
from replicator.context import get_replica_context as get_replica_context
from replicator.context import replica_key as replica_key
from replicator.context_parallel import context_attention as context_attention  # "context" axis
from replicator.diloco import DiLoCo as DiLoCo
from replicator.errors import UserError as UserError
from replicator.losses import compute_average_loss as compute_average_loss
from replicator.losses import global_sum as global_sum
from replicator.losses import scale_regularization_loss as scale_regularization_loss
from replicator.optim import grad_norm as grad_norm
from replicator.optim import narrow_sum as narrow_sum
from replicator.per_replica import PerReplica as PerReplica
from replicator.pipelining import pipeline as pipeline  # a layer stack over the "stage" axis
from replicator.precision import LossScale as LossScale
from replicator.precision import Policy as Policy
from replicator.precision import apply_policy as apply_policy
from replicator.replicator import ReduceOp as ReduceOp
from replicator.replicator import Replicator as Replicator
from replicator.runtime.processes import initialize as initialize
from replicator.state import TrainState as TrainState

__version__ = "0.1.0"
