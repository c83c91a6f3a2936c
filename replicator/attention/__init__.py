"""Attention, one room: the kernels of each backend and the strategies over a split sequence.

`causal_attention` picks a backend's fused kernel for a whole sequence (`kernels`:
splash on TPU, cuDNN on GPU, XLA anywhere); `context_attention` runs a sequence split
on the mesh axis ``context`` (`context`: the all-gather and ring strategies) block by
block through the kernel interface (`blocks`: a block of queries against a block of
keys, giving its output and log-sum-exp), whose blocks are splash's on TPU (`splash`)
and flash attention in XLA's operations elsewhere (`flash`).
"""

from replicator.attention.context import context_attention as context_attention
from replicator.attention.kernels import IMPLEMENTATIONS as IMPLEMENTATIONS
from replicator.attention.kernels import causal_attention as causal_attention
from replicator.attention.kernels import choose_implementation as choose_implementation
