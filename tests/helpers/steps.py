"""An experiment's train step run over batches on either step path, as the trainer runs it."""

import jax

import replicator as rp


def train_steps(repl, path: str, train_step, state, batches, summarize) -> tuple[list, object]:
    """``train_step`` under ``repl.compile`` (``path='compile'``) or ``repl.run``, one step a
    batch: each step's summarized loss and the parameters after, on the host."""
    if path == "compile":
        step = repl.compile(train_step)
    else:
        step = lambda s, b: repl.run(train_step, s, b)  # noqa: E731
    losses = []
    for batch in batches:
        state, sums = step(state, repl.shard_batch(batch))
        if sums["loss"].ndim:
            sums = repl.reduce(rp.ReduceOp.SUM, sums)
        losses.append(summarize(jax.device_get(sums))["loss"])
    return losses, jax.device_get(state.params)
