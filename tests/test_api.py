"""The public API is curated: this test pins it."""

import replicator as rp

PUBLIC = [
    "AxisNameError",
    "Checkpoints",
    "DiLoCo",
    "LossScale",
    "PerReplica",
    "Policy",
    "ReduceOp",
    "ReplicaContext",
    "Replicator",
    "TrainState",
    "UserError",
    "apply_policy",
    "compute_average_loss",
    "context_attention",
    "get_replica_context",
    "global_sum",
    "grad_norm",
    "initialize",
    "narrow_sum",
    "pipeline",
    "replica_key",
    "scale_regularization_loss",
]


def test_public_names_are_pinned():
    names = sorted(n for n in dir(rp) if not n.startswith("_"))
    modules = sorted(n for n in names if type(getattr(rp, n)).__name__ == "module")
    assert sorted(set(names) - set(modules)) == PUBLIC


def test_replicator_methods_of_the_contract():
    for name in [
        "mesh",
        "num_replicas",
        "context",
        "shard_batch",
        "distribute",
        "replicate",
        "run",
        "reduce",
        "wrap_optimizer",
        "compile",
        "axis_name",
        "process_rows",
        "apply_policy",
        "param_shardings",
        "init",
        "sharding_report",
    ]:
        assert hasattr(rp.Replicator(), name), name


def test_readme_quickstart_runs(capsys):
    import os
    import re

    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    code = re.search(r"## Quickstart\n\n```python\n(.*?)```", readme, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    assert float(capsys.readouterr().out) < 1e-3  # the regression has been learned
