"""An 8B Llama-shaped language model for a TPU pod: the pod example.

Llama 3 8B's shape in this repository's decoder: 32 layers, 4096 wide, 32
heads of 128, rotary positions, no biases, untied input and output embeddings,
context 4096, and an MLP of 21,504 (GELU, two matrices: the parameters and
FLOPs of Llama's 14,336-wide SwiGLU, three matrices). 7.8B parameters with the
byte vocabulary (a tokenizer's ``vocab_size`` adds its embeddings). bf16
compute from float32 parameters and AdamW moments, sharded over every chip
(``fsdp=-1``: 94 GB of state, 1.5 GB per chip of a v5p-128), the 32 blocks one
scanned block that keeps what its backward pass needs but its norms and GELU
(``remat_policy="minimal_with_context"``: no matmul recomputed, and no attention
kernel), Pallas splash attention on TPU. A global batch of 128 windows of 4,096
tokens (0.5M tokens a step: two windows per chip on a v5p-128).

Compile it for the pod before anything else (any machine with the ``tpu``
extra; the numbers are in ``docs/benchmarks.md``, "TPU programs"):

    python -m replicator compile --config configs/lm_8b.py --topology v5p-128 --python 3.12
    python -m replicator compile --config configs/lm_8b.py --topology v5p-128 --slices 2

The train step needs 25.8 GiB of a v5p chip's 95.74 with the pods' compiler
(``--python 3.12``: jax 0.12.0.1, libtpu 0.0.52; parameters 466 MiB, AdamW state
932 MiB), 27.2 GiB with Python 3.11's (jax 0.10.2, libtpu 0.0.42.1), compiled from a
CPU host; its roofline is 931 ms a step, bound by compute: 89.6% MFU at the
roofline, ``6 N T / (step x 64 chips x 459 TFLOP/s)`` with N = 7.79B parameters in
matrix products and T = 524,288 tokens (MaxText's llama3-8b at this batch and
context, remat ``full``: 72.8% by the same count; ``docs/benchmarks.md``). ``compile
--fit`` (each candidate compiled; nothing ran) found no remat in two microbatches
fastest; ``minimal_with_context``, added after, is as fast in one step and half the
memory, the tie the search now gives to memory:

    python -m replicator compile --config configs/lm_8b.py --topology v5p-128 --fit

    candidate                          HBM/chip   roofline   MFU at roofline
    remat minimal_with_context         27.2 GiB   931 ms     89.6%  (shipped; alone)
    remat None, 2 microbatches         55.2 GiB   931 ms     89.6%
    remat minimal                      25.1 GiB   952 ms     87.5%
    remat minimal_offloaded             9.9 GiB   952 ms     (+18.5 GiB a step over PCIe)
    remat save_dot_except_mlp          15.4 GiB   1.05 s     79.2%
    remat save_qkv_proj                14.0 GiB   1.07 s     77.8%
    remat full (shipped before)         8.4 GiB   1.13 s     73.8%
    remat None, 1 microbatch            106 GiB   does not fit

then launch it on the pod (``docs/pods.md``):

    python -m replicator launch tpu --tpu my-v5p --zone us-east5-a -- \\
        train --config configs/lm_8b.py --workdir gs://B/lm_8b

which runs on every worker:

    python -m replicator train --config configs/lm_8b.py --workdir gs://B/lm_8b

Data: every ``.py`` file of the interpreter's standard library in windows of
4,096 bytes (``python_stdlib/all_4096``, built offline on first use), a stand-in:
point ``dataset`` at your own corpus (``configs/lm_gpt2_124m.py`` says how).

Expected: not measured (no TPU was available when it was written). The compiled
program's roofline puts a step at 0.93 s on a v5p-128, so the 1,000 steps would
take at least 16 minutes on one.
Smoke mode for tests: ``--config configs/lm_8b.py:smoke``.
"""

import ml_collections

from replicator.trainer.config import base_config


def get_config(mode: str = "") -> ml_collections.ConfigDict:
    c = base_config(mode)
    c.experiment = "experiments.lm"
    c.model = dict(
        vocab_size=256,  # bytes; a tokenizer's vocabulary, padded to a multiple of 128
        num_layers=32,
        num_heads=32,
        embed_dim=4096,
        mlp_dim=21504,  # the parameters of Llama's 3 x 14,336 SwiGLU in two GELU matrices
        max_len=4096,
        positions="rotary",
        tie_embeddings=False,
        use_bias=False,
        dropout_rate=0.0,
        attention="auto",  # splash on TPU, cuDNN on GPUs in bf16/fp16, XLA elsewhere
        scan_layers=True,
        loss_chunk=0,
    )
    c.dataset = "python_stdlib/all_4096"
    c.batch_size = 128  # global, in windows of 4096 tokens
    c.eval_batch_size = 128
    c.num_train_steps = 1000
    c.learning_rate = 3e-4
    c.optimizer = "adamw"
    c.optimizer_args = dict(b1=0.9, b2=0.95)
    c.weight_decay = 0.1
    c.lr_schedule = "cosine"
    c.warmup_steps = 100
    c.lr_end_fraction = 0.1
    c.grad_clip_norm = 1.0
    c.seed = 0
    c.mesh = dict(data=1, fsdp=-1, tensor=1)
    c.step_path = "compile"
    c.precision = "bf16"
    c.remat_policy = "minimal_with_context"  # as fast as None on a v5p-128, half its memory
    c.log_every_steps = 10
    c.eval_every_steps = 500
    c.checkpoint_every_steps = 250
    c.best_metric = "loss"
    c.best_mode = "min"

    if mode == "smoke":
        c.model.update(num_layers=2, num_heads=2, embed_dim=32, mlp_dim=128, max_len=128)
        c.dataset = "python_stdlib/modules_128"
        c.batch_size = 16
        c.eval_batch_size = 64
        c.num_train_steps = 4
        c.warmup_steps = 2
        c.log_every_steps = 2
        c.eval_every_steps = 2
        c.checkpoint_every_steps = 2
    return c
