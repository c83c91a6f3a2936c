"""``python -m replicator plot WORKDIR``: PNG plots of a run's metrics."""

from __future__ import annotations

import io
import json

from replicator import storage

_NOT_PLOTTED = {"step", "split", "num_examples", "sidecar", "steps"}


def plot_metrics(workdir: str) -> list[str]:
    """Writes a PNG plot per metric of ``WORKDIR/metrics.jsonl``: train and eval curves.

    Every numeric key of the train and eval records gets its own plot (loss,
    accuracy, perplexity, examples_per_sec, ...), whatever the experiment.

    Args:
      workdir: a run's directory, local or ``gs://``.

    Returns:
      The paths of the PNG files written into ``WORKDIR/plots/``.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    text = storage.read_text(storage.join(workdir, "metrics.jsonl"))
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    series: dict[str, dict[str, list]] = {}  # metric -> split -> [(step, value)]
    for r in records:
        split = r.get("split", "train")
        if split == "summary":
            continue
        for key, value in r.items():
            if key not in _NOT_PLOTTED and isinstance(value, int | float):
                series.setdefault(key, {}).setdefault(split, []).append((r["step"], value))
    paths = []
    for key, splits in sorted(series.items()):
        fig, ax = plt.subplots(figsize=(6, 4))
        for split, points in splits.items():
            ax.plot(*zip(*points), marker=None if split == "train" else "o", label=split)
        ax.set_xlabel("step")
        ax.set_ylabel(key.replace("_per_sec", " / s").replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend()
        path = storage.join(workdir, "plots", f"{key}.png")
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=100)
        plt.close(fig)
        storage.write_bytes(path, png.getvalue())
        paths.append(path)
    return paths
