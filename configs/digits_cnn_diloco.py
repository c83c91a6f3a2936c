"""The offline default trained as DiLoCo islands: 4 islands of 2 replicas on 8 devices.

The tutorial CNN of ``digits_cnn.py`` on the same data and steps, but the
replicas along ``data`` are 4 islands that sum gradients only among their own
2 replicas (``fsdp``, here plain data parallelism: the parameters stay
replicated inside an island) and meet every ``inner_steps`` steps: the islands
average their change of the parameters, a Nesterov outer step applies it, and
every island starts again from the result (`replicator.parallel.diloco`).
Parameter-sized traffic between islands drops ``inner_steps``-fold. Evaluation
uses the outer parameters.

Expected: 98.3% test accuracy with seed 0 (synchronous data parallelism,
``digits_cnn.py``: 98.9%), sending 23x fewer bytes between islands (the run
summary's ``cross_island_bytes_per_step``), in about 15 s on a 2-core CPU.

    python -m replicator train --config configs/digits_cnn_diloco.py \\
      --workdir runs/digits_cnn_diloco --cpu_devices=8

Training needs exactly 8 devices: ``--cpu_devices=8`` splits a CPU host into 8;
elsewhere, give a mesh for the devices there are, e.g. 2 islands of 2 on 4:
``--config.mesh="{'data': 2, 'fsdp': 2}"``.
``python -m replicator eval --workdir runs/digits_cnn_diloco`` evaluates the
outer parameters on any number of devices, without flags.

Every DiLoCo knob can be overridden, e.g. ``--config.diloco.inner_steps=50``.
Smoke mode for tests: ``--config configs/digits_cnn_diloco.py:smoke``.
"""

import ml_collections

from replicator.trainer.config import config_beside, diloco_settings


def get_config(mode: str = "") -> ml_collections.ConfigDict:
    c = config_beside(__file__, "digits_cnn.py", mode)  # model, data, steps, inner optimizer
    c.mesh = {"data": 4, "fsdp": 2}  # 4 islands x 2 replicas: needs 8 devices
    c.diloco = diloco_settings(inner_steps=2 if mode == "smoke" else 20)
    return c
