"""Llama 3 8B fine-tuned with LoRA: ``configs/llama3_8b.py`` with rank-16 adapters on
every projection of its blocks and the 8.03B base weights frozen.

The adapters (``model.lora_rank=16``, ``lora_alpha=32``, the default ``lora_targets``:
the attention's q, kv and out kernels and the MLP's gate, up and down) hold 42M
parameters, 0.5% of the model; the base takes no gradient and holds no optimizer state
(`experiments/lm/lora.py`), so AdamW's moments are those of the adapters alone. The
step is the 8B's (bf16 compute, splash attention, logits 2,048 positions at a time)
with a global batch of 16 windows of 8,192 tokens and full remat, sized for a v5e-16
(one window per chip, 16 GiB of HBM each). ``model.lora_quantize='nf4'`` stores the
frozen kernels in 4 bits (QLoRA) for a smaller slice still.

Check the fit before renting the slice (any machine with the ``tpu`` extra; nothing
runs, ``compile`` reads no weights):

    python -m replicator compile --config configs/lora_llama3_8b.py --topology v5e-16
    python -m replicator compile --config configs/llama3_8b.py --topology v5e-16 \\
        --config.batch_size=16 --config.remat_policy=full

Compiled from a CPU host (jax 0.10.2, libtpu 0.0.42.1), per chip, against full
fine-tuning of the same step (``llama3_8b.py`` at the same batch and remat):

    topology  run        parameters  optimizer state  HBM total          roofline
    v5e-16    full FT    1.87 GiB    3.74 GiB         13.8 of 15.75 GiB  2.86 s
    v5e-16    LoRA       1.88 GiB      20 MiB          8.7 of 15.75 GiB  2.25 s
    v5p-8     full FT    7.48 GiB    15.0 GiB         50.7 of 95.74 GiB  4.91 s
    v5p-8     LoRA       7.52 GiB      80 MiB         34.1 of 95.74 GiB  3.87 s

The optimizer state shrinks by the frozen share (to 0.52%, the adapters' share of the
parameters); the temporaries lose the base's weight gradients; the step loses their
matmuls (a fifth of the FLOPs), every roofline bound by compute.

For real work, from Meta's weights on your conversations (``docs/pretrained.md``):

    python -m replicator train --config configs/lora_llama3_8b.py --workdir gs://B/lora8b \\
        --config.init_from=hf:/ckpt/llama3 \\
        --config.tokenizer=/ckpt/llama3/tokenizer.json \\
        --config.dataset='chat/files=/data/*.jsonl,tokenizer=/ckpt/llama3,block_size=8191' \\
        --config.objective=sft

then ``export --format peft`` writes the adapters for Hugging Face PEFT (onto the
``init_from`` directory as the base), ``--format hf`` the merged weights.

Expected: not measured (no TPU was available when it was written); by the roofline
the 1,000 steps take at least 38 minutes on a v5e-16. Smoke mode for
tests: ``--config configs/lora_llama3_8b.py:smoke`` (a few steps of a tiny Llama with
rank-4 adapters, bf16, FSDP; about 20 s on a 2-core CPU).
"""

import ml_collections

from replicator.trainer.config import config_beside


def get_config(mode: str = "") -> ml_collections.ConfigDict:
    c = config_beside(__file__, "llama3_8b.py", mode)
    c.model.update(lora_rank=4 if mode == "smoke" else 16, lora_alpha=32.0, lora_dropout=0.0)
    c.learning_rate = 2e-4  # adapters take a larger rate than full fine-tuning
    c.weight_decay = 0.0
    c.warmup_steps = 2 if mode == "smoke" else 20
    if mode != "smoke":
        c.batch_size = 16  # global: one window of 8,192 per chip of a v5e-16
        c.eval_batch_size = 16
        c.remat_policy = "full"
    return c
