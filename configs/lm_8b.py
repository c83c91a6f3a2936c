"""An 8B Llama-shaped language model for a TPU pod: the pod example.

Llama 3 8B's shape in this repository's decoder: 32 layers, 4096 wide, 32
heads of 128, rotary positions, no biases, untied input and output embeddings,
context 4096, and an MLP of 21,504 (GELU, two matrices: the parameters and
FLOPs of Llama's 14,336-wide SwiGLU, three matrices). 7.8B parameters with the
byte vocabulary (a tokenizer's ``vocab_size`` adds its embeddings). bf16
compute from float32 parameters and AdamW moments, sharded over every chip
(``fsdp=-1``: 94 GB of state, 1.5 GB per chip of a v5p-128), the 32 blocks one
scanned block recomputed in the backward pass (``remat_policy='full'``), Pallas
splash attention on TPU. A global batch of 128 windows of 4,096 tokens (0.5M
tokens a step: two windows per chip on a v5p-128).

Compile it for the pod before anything else (any machine with the ``tpu``
extra; the numbers are in ``docs/benchmarks.md``, "TPU programs"):

    python -m replicator compile --config configs/lm_8b.py --topology v5p-128
    python -m replicator compile --config configs/lm_8b.py --topology v5p-128 --slices 2

then launch it on the pod (``docs/pods.md``):

    python -m replicator launch tpu --tpu my-v5p --zone us-east5-a -- \\
        train --config configs/lm_8b.py --workdir gs://B/lm_8b

which runs on every worker:

    python -m replicator train --config configs/lm_8b.py --workdir gs://B/lm_8b

Data: every ``.py`` file of the interpreter's standard library in windows of
4,096 bytes (``python_stdlib/all_4096``, built offline on first use), a stand-in:
point ``dataset`` at your own corpus (``configs/lm_gpt2_124m.py`` says how).

Expected: not measured (no TPU was available when it was written). The compiled
program's roofline (``docs/benchmarks.md``) puts a step at about 1.0 s on a
v5p-128 and 0.5 s on two, so the 1,000 steps would take at least 17 minutes on one.
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
    c.remat_policy = "full"
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
