"""configs/lm_tiny.py trained as DiLoCo islands: 4 islands of 2 replicas on 8 devices.

The same byte-level language model, data, steps and inner optimizer as
``lm_tiny.py``; the replicas along ``data`` are 4 islands that meet every 10
steps (`replicator.parallel.diloco`), sending 10x fewer bytes between islands than
synchronous data parallelism. Evaluation uses the outer parameters.

Expected: eval loss 2.81 after 300 steps with seed 0 (``lm_tiny.py``: 2.14;
with inner Adam, each island's moments see only its own 8 windows a step, and
300 steps are 30 syncs: DiLoCo pays off on long runs over slow links, not
here), about 60 s on a 2-core CPU with 8 fake devices.

    python -m replicator train --config configs/lm_tiny_diloco.py --workdir runs/lm_diloco \\
      --cpu_devices=8

Training needs exactly 8 devices: ``--cpu_devices=8`` splits a CPU host into 8;
elsewhere, give a mesh for the devices there are, e.g. 2 islands of 2 on 4:
``--config.mesh="{'data': 2, 'fsdp': 2}"``.
``python -m replicator eval --workdir runs/lm_diloco`` evaluates the outer
parameters on any number of devices, without flags.

Smoke mode for tests: ``--config configs/lm_tiny_diloco.py:smoke``.
"""

import ml_collections

from replicator.trainer.config import config_beside, diloco_settings


def get_config(mode: str = "") -> ml_collections.ConfigDict:
    c = config_beside(__file__, "lm_tiny.py", mode)
    c.mesh = dict(data=4, fsdp=2, tensor=1)  # 4 islands x 2 replicas: needs 8 devices
    c.diloco = diloco_settings(inner_steps=2 if mode == "smoke" else 10)
    return c
