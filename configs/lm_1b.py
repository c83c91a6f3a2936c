"""A ~1B-parameter byte-level language model, FSDP over one H100 host or a TPU slice.

Trains a 20-layer, 2048-wide, 16-head decoder (head width 128, MLP 8192,
learned positions, tied embeddings, context 2048; 1.01B parameters) in bf16
from float32 parameters with AdamW at 3e-4 (betas 0.9, 0.95; weight decay 0.1;
gradients clipped at norm 1; 50 warmup steps, cosine decay to 10%), a global
batch of 64 windows (131,072 tokens: one window per chip on a v5p-128, four on
a v5e-16). The mesh shards parameters and optimizer state over every device
(``fsdp=-1``), and the activations' batch with them; the 20 blocks are one
scanned block over stacked parameters. Each step runs as four microbatches of 16
windows (``grad_accum_steps=4``: one window per chip of a v5e-16), and the backward
pass recomputes nothing it needs: each block keeps its projections and its
attention's output and log-sum-exp (``remat_policy="minimal_with_context"``,
MaxText's name), its LayerNorms and GELU are recomputed (no matmul). As fast as
keeping everything (``remat_policy=None``) in 40% of the memory. Attention is Pallas
splash attention on TPU (the causal half skipped, no scores in HBM), cuDNN's
fused kernel on GPUs. Data: every ``.py`` file of the interpreter's standard
library (``python_stdlib/all_2048``: about 14,500 train windows of 2,048 bytes,
built offline in about 5 s on first use); 500 steps are about 2.2 epochs.

Compile it for your slice first (the per-chip memory, roofline and collectives,
on any machine with the ``tpu`` extra; ``--python 3.12`` compiles with the JAX and
libtpu the pods run):

    python -m replicator compile --config configs/lm_1b.py --topology v5e-16 --python 3.12

As shipped it needs 2.91 GiB of a v5e chip's 15.75 (3.12 GB), with a roofline of
291 ms per step, compute-bound: 0.79 of MaxText's default program for this shape
(remat ``full``, 366 ms, HBM-bound) and level with MaxText's least-recomputing one
(``minimal_with_context`` in four microbatches, 291.3 ms, 3.27 GB), both compiled by
jax 0.12.0.1 with libtpu 0.0.52 from a CPU host; Python 3.11's compiler (jax 0.10.2,
libtpu 0.0.42.1) makes 3.39 GiB of it. ``docs/benchmarks.md``, "TPU programs".
``compile --fit`` finds the fastest program for another slice: on a v5p-128 (one
window per chip) four microbatches do not divide the batch:
``--config.grad_accum_steps=1``; on one GPU, whose memory holds no 16 windows'
activations unrecomputed, ``--config.remat_policy=full --config.grad_accum_steps=1``
(every block recomputed, only its input kept) is the program of the H100 figures in
docs/benchmarks.md.

Expected: not measured end to end (no accelerator was available when it was
written).

    python -m replicator train --config configs/lm_1b.py --workdir runs/lm_1b

Your own corpus: ``--config.dataset='text_files/block_size=2048,files=/data/corpus/**/*.txt'``
(see ``configs/lm_gpt2_124m.py``). Smoke mode for tests:
``--config configs/lm_1b.py:smoke`` (a few steps of a tiny model, bf16, FSDP mesh).
"""

import ml_collections

from replicator.trainer.config import base_config


def get_config(mode: str = "") -> ml_collections.ConfigDict:
    c = base_config(mode)
    c.experiment = "experiments.lm"
    c.model = dict(
        vocab_size=256,  # bytes
        num_layers=20,
        num_heads=16,
        embed_dim=2048,
        mlp_dim=8192,
        max_len=2048,  # the dataset's block size: windows of max_len + 1 tokens
        positions="learned",  # or "rotary"
        tie_embeddings=True,
        dropout_rate=0.0,
        attention="auto",  # splash on TPU, cuDNN on GPUs in bf16/fp16, XLA elsewhere
        scan_layers=True,  # one scanned block over stacked parameters (False: block_<i>)
        loss_chunk=0,  # e.g. 128: logits 128 positions at a time (large vocabularies); 0: all
    )
    c.dataset = "python_stdlib/all_2048"
    c.batch_size = 64  # global, in windows of 2048 tokens
    c.eval_batch_size = 64
    c.num_train_steps = 500
    c.learning_rate = 3e-4
    c.optimizer = "adamw"
    c.optimizer_args = dict(b1=0.9, b2=0.95)
    c.weight_decay = 0.1  # decoupled, on the matrices only (not biases, norms)
    c.lr_schedule = "cosine"
    c.warmup_steps = 50  # linear warmup, then cosine decay to 10% at num_train_steps
    c.lr_end_fraction = 0.1
    c.grad_clip_norm = 1.0
    c.seed = 0
    c.mesh = dict(data=1, fsdp=-1, tensor=1)  # every axis, so each can be overridden
    # The global view keeps everything sharded inside the step too (the per-replica
    # path gathers each parameter whole for the step: 3.6 GB of float32 here).
    c.step_path = "compile"
    c.precision = "bf16"
    c.remat_policy = "minimal_with_context"  # keep what the backward needs but norms and GELU
    c.grad_accum_steps = 4  # microbatches of 16 windows: one per chip of a v5e-16
    c.log_every_steps = 50
    c.eval_every_steps = 250
    c.checkpoint_every_steps = 250
    c.best_metric = "loss"  # eval loss in nats per token
    c.best_mode = "min"

    if mode == "smoke":
        c.model.update(num_layers=1, num_heads=2, embed_dim=32, mlp_dim=128, max_len=128)
        c.dataset = "python_stdlib/modules_128"
        c.batch_size = 16
        c.grad_accum_steps = 1
        c.eval_batch_size = 64
        c.num_train_steps = 4
        c.warmup_steps = 2
        c.log_every_steps = 2
        c.eval_every_steps = 2
        c.checkpoint_every_steps = 2
    return c
