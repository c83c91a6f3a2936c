"""The mesh and every way of splitting work over it: mesh facts, shardings and the
placement table, activation rules, pipeline stages, experts, ZeRO inside a
per-replica step, DiLoCo's islands."""
