"""Preference tuning (DPO) with LoRA adapters on a pretrained Llama: docs/pretrained.md's
third step, on a laptop's CPU.

Starts from a Hugging Face checkpoint, by default the merged export of
``configs/sft_llama_tiny.py``'s run (``export --workdir runs/sft_tiny --format hf --out
runs/sft_tiny/hf``; ``--config.init_from=hf:runs/tiny-llama`` and the dataset's
``tokenizer=runs/tiny-llama`` start from the tiny random Llama itself), and trains
rank-8 LoRA adapters on every projection of its blocks, the base weights frozen (no
gradient, no optimizer state), on
``examples/post_training/preferences.jsonl`` (600 pairs: the chosen answer right and
polite, the rejected one wrong and curt; ``preferences/`` data, each pair's two
sequences packed whole into one window of 256 tokens) with ``objective='dpo'``
(sigmoid DPO, beta 0.1): the reference log-probabilities are the base model's, the
same weights without the adapters, so nothing is copied. At step 0 the loss is
log 2 = 0.693; TRL's metrics (``rewards/chosen``, ``rewards/rejected``,
``rewards/margins``, ``rewards/accuracies``, ``logps/chosen``, ``logps/rejected``) are
in every record. Adam at 5e-3, a global batch of 8 windows, 60 steps.

    python -m replicator train --config configs/dpo_llama_tiny.py --workdir runs/dpo_tiny

Other losses: ``--config.objective=ipo`` or ``simpo`` (reference-free;
``--config.simpo_gamma``); without adapters (``--config.model.lora_rank=0``) DPO keeps a
frozen copy of the starting weights as the reference.

Expected: from the SFT export, loss 0.0995 on the test pairs after 60 steps with seed
0, ``rewards/accuracies`` 1.0 and ``rewards/margins`` 2.26, about 30 s on a 2-core CPU.
Smoke mode for tests: ``--config configs/dpo_llama_tiny.py:smoke`` (4 steps).
"""

import ml_collections

from replicator.trainer.config import config_beside

MODEL_DIR = "runs/sft_tiny/hf"  # the SFT run's merged export (export --format hf)
DATA = "examples/post_training"


def get_config(mode: str = "") -> ml_collections.ConfigDict:
    c = config_beside(__file__, "sft_llama_tiny.py", mode)  # its batch, mesh and records
    c.init_from = f"hf:{MODEL_DIR}"
    c.tokenizer = f"{MODEL_DIR}/tokenizer.json"
    c.dataset = f"preferences/files={DATA}/preferences.jsonl,tokenizer={MODEL_DIR},block_size=256"
    c.objective = "dpo"
    c.dpo_beta = 0.1
    c.model.update(lora_rank=8, lora_alpha=16.0)
    c.learning_rate = 5e-3
    c.lr_schedule, c.warmup_steps = "constant", 0
    c.best_metric, c.best_mode = "rewards/accuracies", "max"
    return c
