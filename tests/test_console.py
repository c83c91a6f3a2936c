"""What the console shows of a run that is not on a terminal (issue 48): a line per
logged step with every metric of the experiment's, the parallelism a run uses, an
eval's result as a line for a person."""

from __future__ import annotations

import logging

import numpy as np

from replicator.trainer import actions as act
from replicator.trainer.console import parallelism_line, result_line
from replicator.trainer.instruments import ProgressBar
from replicator.trainer.writers import MetricWriter


def _moe_summarize(sums):
    """An LM with experts: three metrics, the last one the MoE's."""
    tokens = float(sums["tokens"])
    return {"loss": float(sums["loss"]) / tokens, "perplexity": 9.5,
            "dropped_fraction": float(sums["dropped"]) / tokens}  # fmt: skip


def test_a_logged_step_off_a_terminal_is_a_line_with_every_metric(tmp_path, caplog):
    writer = MetricWriter(str(tmp_path), writers=())
    progress = ProgressBar(4)  # pytest's stdout is no terminal: lines
    assert not progress.enabled
    log_train = act.LogTrain(writer, progress, _moe_summarize, every_steps=2, per_step=128,
                             unit="tokens", start=0)  # fmt: skip
    sums = {"loss": np.float32(256.0), "tokens": np.float32(128.0), "dropped": np.float32(4.0)}
    with caplog.at_level(logging.INFO, logger="replicator"):
        for step in (1, 2):
            log_train(act.StepEnd(step, step == 2, None, sums, {}, None, None))
        log_train.close()
    writer.close()
    (line,) = [r.getMessage() for r in caplog.records if "train" in r.getMessage()]
    assert line.startswith("step 2  train loss 2  perplexity 9.5  dropped_fraction 0.03125  ")
    assert "tokens_per_sec " in line


def test_quiet_shows_no_lines(caplog):
    progress = ProgressBar(4, enabled=False)
    with caplog.at_level(logging.INFO, logger="replicator"):
        progress.update(2, loss=1.0)
    assert not caplog.records


def test_the_parallelism_line_names_the_pipeline_context_and_experts():
    line = parallelism_line(
        {"pipeline_microbatches": 4, "context_strategy": "gather",
         "model": {"num_experts": 8, "experts_per_token": 2, "moe_every": 2}},
        {"data": 1, "stage": 2, "context": 2, "expert": 2},
    )  # fmt: skip
    assert line == (
        "parallelism: a pipeline of 2 stages over 'stage', 4 microbatches; sequences split "
        "over 'context' (2 devices), attention 'gather'; a mixture of 8 experts (2 per "
        "token) in one block in 2, split over 'expert' (2 devices)"
    )
    assert parallelism_line({"model": {"num_experts": None}}, {"data": 8, "fsdp": 1}) is None


def test_an_eval_result_is_a_line_with_ema_metrics_too():
    result = {"step": 4, "loss": 0.25, "accuracy": 0.5, "ema_accuracy": 0.75, "num_examples": 360}
    assert result_line(result, "test") == (
        "test metrics of step 4: loss 0.25, accuracy 0.5, ema_accuracy 0.75 (360 examples)"
    )
