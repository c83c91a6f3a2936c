"""replicator: TF-Replicator's programming model on modern JAX.

Write a step function as if for one device; `Replicator.run` (per replica, on
`jax.shard_map`) or `Replicator.compile` (global view, `jax.jit` over a mesh)
runs it on every device.
"""

# Public modules: rp.attention (causal_attention per backend, context_attention),
# rp.topology (a TPU slice to compile for), rp.diloco (DiLoCo's outer view, traffic,
# elastic islands), rp.moe (experts over the "expert" axis), rp.ema (an EMA of the
# parameters), rp.offload (state in host memory), rp.remat (MaxText's named policies).
from replicator import attention as attention
from replicator.attention.context import context_attention as context_attention
from replicator.checkpoints.checkpoint import Checkpoints as Checkpoints
from replicator.compiled import topology as topology
from replicator.errors import UserError as UserError
from replicator.parallel import diloco as diloco
from replicator.parallel import moe as moe
from replicator.parallel.diloco import DiLoCo as DiLoCo
from replicator.parallel.pipelining import pipeline as pipeline
from replicator.replicator import ReduceOp as ReduceOp
from replicator.replicator import Replicator as Replicator
from replicator.runtime.processes import initialize as initialize
from replicator.spmd.context import AxisNameError as AxisNameError
from replicator.spmd.context import ReplicaContext as ReplicaContext
from replicator.spmd.context import get_replica_context as get_replica_context
from replicator.spmd.context import replica_key as replica_key
from replicator.spmd.per_replica import PerReplica as PerReplica
from replicator.step import ema as ema
from replicator.step import offload as offload
from replicator.step import remat as remat
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
