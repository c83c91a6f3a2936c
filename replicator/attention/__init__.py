"""Attention, one room: the kernels of each backend and the strategies over a split sequence.

`causal_attention` picks a backend's fused kernel (`kernels`: splash on TPU, cuDNN
on GPU, XLA anywhere); `context_attention` runs it over a sequence split on the
mesh axis ``context`` (`context`: the all-gather and ring strategies), with
`flash` the chunked kernel they fall back on.
"""

from replicator.attention.context import context_attention as context_attention
from replicator.attention.kernels import IMPLEMENTATIONS as IMPLEMENTATIONS
from replicator.attention.kernels import causal_attention as causal_attention
from replicator.attention.kernels import choose_implementation as choose_implementation
