"""A small Vision Transformer on scikit-learn's handwritten digits, or fine-tuned from a
Hugging Face ViT (big_vision's recipe).

From scratch: a ViT of 2x2 patches on the 8x8 scans (16 patches and a [CLS]
token), 4 pre-LayerNorm blocks of width 64 and 4 heads, trained with AdamW
(weight decay 1e-4), a 100-step warmup and a cosine decay, gradients clipped at
norm 1, on the 1,437 training scans of the offline ``digits`` dataset.

Expected: about 97% test accuracy on the 360 test scans (96.9% with seed 0;
95.8% after 500 steps), in 3m50s on a heavily loaded 2-core CPU (107 s computing,
45 s compiling, 41 s setting up; 67 s of CPU time, so about 2 minutes idle).

    python -m replicator train --config configs/digits_vit.py --workdir runs/digits_vit

Fine-tuning a Hugging Face ``ViTModel`` or ``ViTForImageClassification`` saved in
a local directory (config.json + model.safetensors): its config.json sets the
backbone's shape (patch size, width, depth, heads, channels; grayscale scans are
repeated to RGB); the scans are resized to ``image_size``, the position
embeddings resampled (bicubic) to that grid, and the head of 10 classes starts
fresh (zero), as big_vision fine-tunes. A ViT-B/16 sees 224x224 images (an
accelerator's job):

    python -m replicator train --config configs/digits_vit.py --workdir runs/digits_vit_ft \\
        --config.init_from=hf:/models/vit-base-patch16-224 --config.model.image_size=224 \\
        --config.learning_rate=3e-4 --config.num_train_steps=500 --config.batch_size=32

Smoke mode for tests: ``--config configs/digits_vit.py:smoke`` (a tiny ViT, a few steps).
"""

import ml_collections

from replicator.trainer.config import base_config


def get_config(mode: str = "") -> ml_collections.ConfigDict:
    c = base_config(mode)  # every key with its default, so every key can be overridden
    c.experiment = "experiments.classify"
    c.model = dict(
        arch="vit", num_classes=10, image_size=8, patch_size=2, embed_dim=64, num_layers=4,
        num_heads=4, mlp_dim=128, num_channels=1,
    )  # fmt: skip
    c.dataset = "digits"

    c.batch_size = 64  # global
    c.eval_batch_size = 120
    c.num_train_steps = 1500  # about 67 epochs of 1,437 examples
    c.optimizer = "adamw"
    c.learning_rate = 1e-3
    c.weight_decay = 1e-4
    c.lr_schedule = "cosine"
    c.warmup_steps = 100
    c.grad_clip_norm = 1.0
    c.seed = 0

    c.log_every_steps = 50
    c.eval_every_steps = 500
    c.checkpoint_every_steps = 500

    if mode == "smoke":
        c.model = dict(
            arch="vit", num_classes=10, image_size=8, patch_size=4, embed_dim=32, num_layers=1,
            num_heads=2, mlp_dim=64, num_channels=1,
        )  # fmt: skip
        c.num_train_steps = 4
        c.warmup_steps = 1
        c.log_every_steps = 2
        c.eval_every_steps = 2
        c.checkpoint_every_steps = 2
    return c
