"""replicator: TF-Replicator's programming model on modern JAX.

Write a step function as if for one device; `Replicator.run` (per replica, on
`jax.shard_map`) or `Replicator.compile` (global view, `jax.jit` over a mesh)
runs it on every device.
"""

from replicator import attention as attention  # rp.attention.causal_attention, per backend
from replicator.attention.context import context_attention as context_attention  # "context" axis
from replicator.checkpoints.checkpoint import Checkpoints as Checkpoints
from replicator.compiled import (
    topology as topology,  # rp.topology.devices: a TPU slice to compile for
)
from replicator.errors import UserError as UserError
from replicator.parallel import moe as moe  # rp.moe.moe_layer: experts over the "expert" axis
from replicator.parallel.diloco import DiLoCo as DiLoCo
from replicator.parallel.pipelining import (
    pipeline as pipeline,  # a layer stack over the "stage" axis
)
from replicator.replicator import ReduceOp as ReduceOp
from replicator.replicator import Replicator as Replicator
from replicator.runtime.processes import initialize as initialize
from replicator.spmd.context import AxisNameError as AxisNameError
from replicator.spmd.context import ReplicaContext as ReplicaContext
from replicator.spmd.context import get_replica_context as get_replica_context
from replicator.spmd.context import replica_key as replica_key
from replicator.spmd.per_replica import PerReplica as PerReplica
from replicator.step import ema as ema  # rp.ema.track: an EMA of the parameters
from replicator.step import offload as offload  # rp.offload: state in host memory between steps
from replicator.step import remat as remat  # rp.remat.checkpoint_policy: MaxText's named policies
from replicator.step.losses import compute_average_loss as compute_average_loss
from replicator.step.losses import global_sum as global_sum
from replicator.step.losses import scale_regularization_loss as scale_regularization_loss
from replicator.step.optim import grad_norm as grad_norm
from replicator.step.optim import narrow_sum as narrow_sum
from replicator.step.precision import LossScale as LossScale
from replicator.step.precision import Policy as Policy
from replicator.step.precision import apply_policy as apply_policy
from replicator.step.state import TrainState as TrainState

__version__ = "0.1.0"
