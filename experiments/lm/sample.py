"""Sampling a trained LM: one prefill of the prompts, then one-token decode steps.

`Sampler` compiles two programs for a model over a mesh: ``prefill`` runs the
left-padded prompts through the model once, filling a `KVCache`
(`experiments.lm.kv_cache`), and picks each row's first new token; ``decode``
feeds the last token of every row, appends its keys and values to the cache and
picks the next. Each compiles once per batch shape and sampling settings, however
many tokens are generated: the Python loop only dispatches them, and checks for
stop tokens every `_CHECK_EVERY` steps.

Prompts of different lengths are left-padded to the longest (so one
dynamic-update-slice writes every row's new token at the same slot); each row's
positions count from its first real token and its padding is masked, so a row
generates exactly what it would alone. Every row draws from a key of its own,
``fold_in(fold_in(key(seed), prompt), sample)``, so a sample depends on its seed,
prompt and sample number, not on what else is in the batch.

Over a `replicator.Replicator`'s mesh the parameters stay in their (FSDP, tensor)
shardings, the cache is split over the data axes by rows and over ``tensor`` by
kv heads (where they divide), and the small per-row outputs are mirrored, so every
process can read them.

`make_sampler` is the LM experiment's hook for ``python -m replicator sample``
(`replicator.trainer.sample_command`): a `TextSampler`, the `Sampler` with the
run's tokenizer.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.lm import kv_cache
from replicator.errors import ConfigError

log = logging.getLogger("replicator")

_CHECK_EVERY = 16  # decode steps between looks at whether every row has stopped


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """How to continue the prompts.

    Attributes:
      max_new_tokens: tokens to generate per sample (fewer where a stop token comes
        first, or where the model's ``max_len`` ends).
      temperature: 0 is greedy (the argmax); otherwise logits are divided by it.
      top_k: sample among the ``top_k`` likeliest tokens only (0: all).
      top_p: nucleus sampling: among the likeliest tokens whose probabilities add up
        to ``top_p`` (1.0: all).
      seed: the sampling seed; the same seed gives the same samples.
      num_samples: samples per prompt.
      stop_ids: tokens that end a sample (kept as its last token).
    """

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    num_samples: int = 1
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self):
        checks = (
            (self.max_new_tokens >= 1, f"max_new_tokens={self.max_new_tokens}: give 1 or more"),
            (self.temperature >= 0, f"temperature={self.temperature}: give 0 (greedy) or more"),
            (self.top_k >= 0, f"top_k={self.top_k}: give 0 (off) or more"),
            (0 < self.top_p <= 1, f"top_p={self.top_p}: give a value in (0, 1]"),
            (self.num_samples >= 1, f"num_samples={self.num_samples}: give 1 or more"),
        )
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


class Sample(NamedTuple):
    """One continuation.

    Attributes:
      prompt_index, sample_index: which prompt, and which of its samples.
      prompt_ids: the prompt's tokens.
      ids: the generated tokens only (a stop token that ended it last).
      finish_reason: ``"stop"`` (a stop token) or ``"length"``.
    """

    prompt_index: int
    sample_index: int
    prompt_ids: tuple[int, ...]
    ids: tuple[int, ...]
    finish_reason: str


def filter_logits(logits_BxV: jax.Array, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """``logits`` with the tokens outside the ``top_k`` likeliest and outside the nucleus
    ``top_p`` set to ``-inf`` (the nucleus: the fewest likeliest tokens whose
    probabilities reach ``top_p``; the likeliest is always kept, and a token tied with
    the last one kept is kept too). 0 and 1.0 turn each off.

    >>> logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    >>> jnp.isfinite(filter_logits(logits, top_k=3)).tolist()
    [[True, True, True, False]]
    >>> jnp.isfinite(filter_logits(logits, top_p=0.7)).tolist()
    [[True, True, False, False]]
    """
    vocab = logits_BxV.shape[-1]
    if top_k and top_k < vocab:
        kth_Bx1 = jax.lax.top_k(logits_BxV, top_k)[0][..., -1:]
        logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
    if top_p < 1.0:
        sorted_BxV = -jnp.sort(-logits_BxV, axis=-1)
        probs_BxV = jax.nn.softmax(sorted_BxV.astype(jnp.float32), axis=-1)
        before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV  # mass of the likelier ones
        kept_BxV = jnp.where(before_BxV < top_p, sorted_BxV, jnp.inf)
        threshold_Bx1 = jnp.min(kept_BxV, axis=-1, keepdims=True)
        logits_BxV = jnp.where(logits_BxV < threshold_Bx1, -jnp.inf, logits_BxV)
    return logits_BxV


def choose_tokens(
    logits_BxV: jax.Array,
    keys_B: jax.Array,
    step: jax.Array,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    vocab_size: int | None = None,
) -> jax.Array:
    """Each row's next token: the argmax at temperature 0, else a draw from
    ``softmax(filter_logits(logits / temperature))`` with the row's key folded with
    ``step``. Tokens from ``vocab_size`` on (a padded vocabulary) are never chosen.

    >>> logits = jnp.array([[0.0, 2.0, 1.0]])
    >>> choose_tokens(logits, jax.random.split(jax.random.key(0), 1), 0, temperature=0).tolist()
    [1]
    """
    logits_BxV = logits_BxV.astype(jnp.float32)
    if vocab_size is not None and vocab_size < logits_BxV.shape[-1]:
        logits_BxV = jnp.where(jnp.arange(logits_BxV.shape[-1]) < vocab_size, logits_BxV, -jnp.inf)
    if temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits_BxV = filter_logits(logits_BxV / temperature, top_k, top_p)
    step_keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_B, step)
    return jax.vmap(jax.random.categorical)(step_keys_B, logits_BxV).astype(jnp.int32)


def left_pad(prompts: Sequence[Sequence[int]], rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The prompts right-aligned in ``[rows, longest]`` int32 (rows past the prompts
    repeat the last one: filler for an even split), and each row's first real slot.

    >>> tokens, start = left_pad([[5, 6, 7], [8]], rows=2)
    >>> tokens.tolist(), start.tolist()
    ([[5, 6, 7], [0, 0, 8]], [0, 2])
    """
    longest = max(len(p) for p in prompts)
    tokens = np.zeros((rows, longest), np.int32)
    start = np.zeros((rows,), np.int32)
    for row in range(rows):
        prompt = prompts[min(row, len(prompts) - 1)]
        start[row] = longest - len(prompt)
        tokens[row, start[row] :] = prompt
    return tokens, start


@flax.struct.dataclass
class DecodeState:
    """What one decode step hands the next: the cache, the tokens so far ``[B, N]``,
    each row's last token and whether it has stopped, the step, the rows' keys."""

    cache: kv_cache.KVCache
    tokens: jax.Array
    last: jax.Array
    done: jax.Array
    step: jax.Array
    keys: jax.Array


class Sampler:
    """Continues prompts with a `experiments.lm.model.Transformer` and a `KVCache`.

    Args:
      model: the `Transformer`, or the precision policy's wrapper of it
        (``repl.apply_policy(model)``: it computes in the policy's dtype, and so does
        the cache).
      repl: the `replicator.Replicator` whose mesh the parameters live on; None runs
        plain `jax.jit` on the default device.
      vocab_size: None, or never choose tokens from this one on (a vocabulary padded
        beyond the tokenizer's; by default every token can come, as from HF's greedy
        search, so that temperature 0 is the model's argmax).

    Attributes:
      traces: how many times each program (``"prefill"``, ``"decode"``) was traced.

    >>> from experiments.lm.model import Transformer
    >>> model = Transformer(vocab_size=16, num_layers=1, num_heads=2, embed_dim=8, max_len=8)
    >>> params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    >>> samples = Sampler(model).generate(params, [[1, 2, 3], [4]],
    ...                                   SamplingOptions(max_new_tokens=4, temperature=0))
    >>> [len(s.ids) for s in samples]
    [4, 4]
    """

    def __init__(self, model: Any, *, repl: Any = None, vocab_size: int | None = None):
        self.module = getattr(model, "module", model)  # a PolicyModel's own model
        self.policy = getattr(model, "policy", None)
        self.repl = repl
        self.vocab_size = vocab_size
        self.traces: collections.Counter = collections.Counter()
        self._programs: dict[Any, Any] = {}

    @property
    def max_len(self) -> int:
        """The model's context: a prompt and its continuation fit in it."""
        return self.module.max_len

    def generate(
        self, params: Any, prompts: Sequence[Sequence[int]], options: SamplingOptions
    ) -> list[Sample]:
        """``options.num_samples`` continuations of each prompt, in order (prompt, sample).

        Raises:
          ConfigError: no prompt, an empty one, a token outside the vocabulary, or a
            prompt that leaves no room in ``max_len``.
        """
        prompts = [tuple(int(t) for t in p) for p in prompts]
        new = self.check(prompts, options)
        rows_in = len(prompts) * options.num_samples
        unit = 1 if self.repl is None else self.repl.num_replicas
        rows = -(-rows_in // unit) * unit  # filler rows split the batch evenly
        repeated = [p for p in prompts for _ in range(options.num_samples)]
        tokens_BxP, start_B = left_pad(repeated, rows)
        keys_B = _row_keys(options.seed, len(prompts), options.num_samples, rows)
        prefill, decode = self._compiled(options, new, tokens_BxP.shape)
        state = prefill(params, *self._place((tokens_BxP, start_B)), keys_B)
        for step in range(1, new):
            if step % _CHECK_EVERY == 0 and bool(np.all(jax.device_get(state.done))):
                break
            state = decode(params, state)
        tokens = np.asarray(jax.device_get(state.tokens))[:, : int(jax.device_get(state.step))]
        stop = set(options.stop_ids)
        samples = []
        for row, prompt in enumerate(repeated):
            ids, reason = [], "length"
            for token in tokens[row].tolist():
                ids.append(token)
                if token in stop:
                    reason = "stop"
                    break
            prompt_index, sample_index = divmod(row, options.num_samples)
            samples.append(Sample(prompt_index, sample_index, prompt, tuple(ids), reason))
        return samples

    def check(self, prompts: Sequence[Sequence[int]], options: SamplingOptions) -> int:
        """One-line `ConfigError`s for prompts that cannot be continued; returns the
        tokens to generate (``max_new_tokens``, fewer where ``max_len`` ends first)."""
        if not prompts:
            raise ConfigError("no prompt to continue")
        if any(not p for p in prompts):
            raise ConfigError("an empty prompt: give at least one token")
        vocab = self.module.vocab_size
        bad = sorted({t for p in prompts for t in p if not 0 <= t < vocab})
        if bad:
            raise ConfigError(
                f"prompt tokens {bad[:8]} are outside the vocabulary (0..{vocab - 1})"
            )
        longest = max(len(p) for p in prompts)
        if longest >= self.max_len:
            raise ConfigError(
                f"a prompt of {longest} tokens leaves no room in the model's max_len "
                f"{self.max_len}: give at most {self.max_len - 1}"
            )
        new = min(options.max_new_tokens, self.max_len - longest + 1)
        if new < options.max_new_tokens:
            log.warning(
                "generating %d tokens, not %d: the longest prompt (%d tokens) and its "
                "continuation fill the model's max_len %d",
                new, options.max_new_tokens, longest, self.max_len,
            )  # fmt: skip
        return new

    def _place(self, arrays: tuple[np.ndarray, ...]) -> tuple[Any, ...]:
        if self.repl is None:
            return tuple(jnp.asarray(a) for a in arrays)
        sharding = self.repl.batch_sharding
        return tuple(
            jax.make_array_from_callback(a.shape, sharding, lambda index, a=a: a[index])
            for a in arrays
        )

    def _apply(self, params: Any, tokens_BxT: jax.Array, cache: kv_cache.KVCache):
        if self.policy is not None:
            params = self.policy.cast_to_compute(params)
        return self.module.apply({"params": params}, tokens_BxT, cache=cache)

    def _cache_dtype(self) -> Any:
        if self.policy is not None:
            return self.policy.compute_dtype
        return self.module.dtype or jnp.float32

    def _compiled(self, options: SamplingOptions, new: int, shape: tuple[int, int]):
        """The prefill and decode programs for these settings and this batch shape."""
        key = (options.temperature, options.top_k, options.top_p, options.stop_ids, new, shape)
        if key in self._programs:
            return self._programs[key]
        choose = dict(
            temperature=options.temperature, top_k=options.top_k, top_p=options.top_p,
            vocab_size=self.vocab_size,
        )  # fmt: skip
        stop_ids = jnp.asarray(options.stop_ids or (-1,), jnp.int32)
        length = shape[1] + new - 1  # the last new token is never fed back

        def prefill(params, tokens_BxP, start_B, keys_B):
            self.traces["prefill"] += 1
            cache = kv_cache.init_cache(self.module, start_B, length, self._cache_dtype())
            logits_BxPxV, cache = self._apply(params, tokens_BxP, cache)
            first_B = choose_tokens(logits_BxPxV[:, -1], keys_B, 0, **choose)
            tokens_BxN = jnp.zeros((shape[0], new), jnp.int32).at[:, 0].set(first_B)
            done_B = jnp.isin(first_B, stop_ids)
            return DecodeState(cache, tokens_BxN, first_B, done_B, jnp.ones((), jnp.int32), keys_B)

        def decode(params, state):
            self.traces["decode"] += 1
            logits_Bx1xV, cache = self._apply(params, state.last[:, None], state.cache)
            next_B = choose_tokens(logits_Bx1xV[:, -1], state.keys, state.step, **choose)
            next_B = jnp.where(state.done, 0, next_B)  # a stopped row idles
            tokens_BxN = jax.lax.dynamic_update_slice(
                state.tokens, next_B[:, None], (0, state.step)
            )
            done_B = state.done | jnp.isin(next_B, stop_ids)
            return DecodeState(cache, tokens_BxN, next_B, done_B, state.step + 1, state.keys)

        if self.repl is None:
            programs = jax.jit(prefill), jax.jit(decode, donate_argnums=(1,))
        else:
            shardings = self.state_shardings()
            programs = (
                self.repl.compile(prefill, out_shardings=shardings),
                self.repl.compile(decode, donate_argnums=(1,), out_shardings=shardings),
            )
        self._programs[key] = programs
        return programs

    def decode_program(self, params: Any, batch: int, length: int) -> tuple[Any, tuple]:
        """The greedy decode step for ``batch`` rows and a cache of ``length`` slots,
        and its arguments as `jax.ShapeDtypeStruct`s with their shardings: what
        `replicator.trainer.aot` compiles for a topology (``params`` may be abstract).

        Returns:
          ``(step, args)``: ``step.lower(*args)`` lowers it.
        """
        _, decode = self._compiled(SamplingOptions(temperature=0), length, (batch, 1))
        layers, kv_heads, head_dim = kv_cache.cache_dims(self.module)
        kv = jax.ShapeDtypeStruct((layers, batch, length, kv_heads, head_dim), self._cache_dtype())
        scalar, row = jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32)
        keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), batch))
        state = DecodeState(
            kv_cache.KVCache(kv, kv, scalar, row), jax.ShapeDtypeStruct((batch, length), jnp.int32),
            row, jax.ShapeDtypeStruct((batch,), jnp.bool_), scalar, keys,
        )  # fmt: skip
        state = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            state, self.state_shardings(),
        )  # fmt: skip
        return decode, (params, state)

    def state_shardings(self) -> DecodeState:
        """Where a `DecodeState` lives on the mesh: the cache's rows over the data axes
        and its kv heads over ``tensor`` (where they divide), the rest mirrored."""
        mesh = self.repl.mesh
        rows = self.repl.batch_sharding.spec[0]
        _, kv_heads, _ = kv_cache.cache_dims(self.module)
        tensor = mesh.shape.get("tensor", 1)
        heads = "tensor" if tensor > 1 and kv_heads % tensor == 0 else None
        kv = NamedSharding(mesh, P(None, rows, None, heads, None))
        mirrored = self.repl.mirrored_sharding
        cache = kv_cache.KVCache(kv, kv, mirrored, NamedSharding(mesh, P(rows)))
        return DecodeState(cache, mirrored, mirrored, mirrored, mirrored, mirrored)


def _row_keys(seed: int, prompts: int, samples: int, rows: int) -> jax.Array:
    """Each row's key: ``fold_in(fold_in(key(seed), prompt), sample)`` (filler rows
    repeat the last real row's)."""
    base = jax.random.key(seed)
    keys = []
    for row in range(rows):
        prompt, sample = divmod(min(row, prompts * samples - 1), samples)
        keys.append(jax.random.fold_in(jax.random.fold_in(base, prompt), sample))
    return jnp.stack(keys)


def generate(
    model: Any,
    params: Any,
    prompts: Sequence[Sequence[int]],
    *,
    repl: Any = None,
    **options: Any,
) -> list[Sample]:
    """Continues ``prompts`` (token ids) with ``model``: `Sampler` for one call.

    Args:
      model: a `experiments.lm.model.Transformer` (or ``repl.apply_policy`` of one).
      params: its parameters (the ``"params"`` collection).
      prompts: one list of token ids per prompt; lengths may differ.
      repl: the `replicator.Replicator` whose mesh ``params`` live on, or None.
      **options: `SamplingOptions`' fields (``max_new_tokens``, ``temperature``,
        ``top_k``, ``top_p``, ``seed``, ``num_samples``, ``stop_ids``).

    Returns:
      One `Sample` per prompt and sample, in order.

    >>> from experiments.lm.model import Transformer
    >>> model = Transformer(vocab_size=16, num_layers=1, num_heads=2, embed_dim=8, max_len=8)
    >>> params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    >>> [s.ids for s in generate(model, params, [[1, 2]], max_new_tokens=3, seed=1)] == [
    ...     s.ids for s in generate(model, params, [[1, 2]], max_new_tokens=3, seed=1)]
    True
    """
    return Sampler(model, repl=repl).generate(params, prompts, SamplingOptions(**options))


class TextSampler:
    """A `Sampler` with the run's tokenizer: what `make_sampler` gives the trainer.

    Attributes:
      sampler: the `Sampler`.
      tokenizer: the tokenizer (``encode``, ``decode``, ``eos_id``, ``bos_id``), or None:
        prompts as ids only, samples without text.
    """

    def __init__(self, sampler: Sampler, tokenizer: Any):
        self.sampler, self.tokenizer = sampler, tokenizer

    @property
    def max_len(self) -> int:
        """The model's context."""
        return self.sampler.max_len

    @property
    def eos_id(self) -> int | None:
        """The tokenizer's end of document: the default stop token."""
        return None if self.tokenizer is None else self.tokenizer.eos_id

    def encode(self, text: str) -> list[int]:
        """``text``'s tokens, after the tokenizer's ``bos_id`` where it has one of its own
        (as Hugging Face's tokenizers do for Llama and Mistral; GPT-2's, whose begin and
        end are one token, and Qwen2's, with none, add nothing)."""
        if self.tokenizer is None:
            raise ConfigError("this sampler has no tokenizer: give the prompts as token ids")
        ids = list(self.tokenizer.encode(text))
        bos = getattr(self.tokenizer, "bos_id", None)
        if bos is None or bos == self.tokenizer.eos_id or ids[:1] == [bos]:
            return ids
        return [bos, *ids]

    def decode(self, ids: Sequence[int]) -> str | None:
        """The text of generated tokens (bytes: UTF-8, undecodable ones replaced; a token
        beyond the tokenizer's vocabulary, from a padded one, U+FFFD); None without a
        tokenizer."""
        if self.tokenizer is None:
            return None
        vocab = getattr(self.tokenizer, "vocab_size", None) or math.inf
        text, run = [], []
        for token in [*ids, None]:
            if token is not None and token < vocab:
                run.append(int(token))
                continue
            text.append(self.tokenizer.decode(run) if run else "")
            run = []
            if token is not None:
                text.append("\ufffd")
        return "".join(text)

    def check(self, prompts: Sequence[Sequence[int]], **options) -> None:
        """`Sampler.check` with `SamplingOptions` from keyword arguments."""
        self.sampler.check(prompts, SamplingOptions(**options))

    def generate(self, params: Any, prompts: Sequence[Sequence[int]], **options) -> list[Sample]:
        """`Sampler.generate` with `SamplingOptions` from keyword arguments."""
        return self.sampler.generate(params, prompts, SamplingOptions(**options))

    def decode_program(self, params: Any, batch: int, length: int) -> tuple[Any, tuple]:
        """`Sampler.decode_program`."""
        return self.sampler.decode_program(params, batch, length)


def make_sampler(settings: Any, tokenizer: str | None = "bytes") -> TextSampler:
    """The LM experiment's sampling hook (`replicator.trainer.sample_command`).

    Args:
      settings: the trainer's `replicator.trainer.Settings` (model keys, Replicator).
      tokenizer: the config's ``tokenizer``: ``"bytes"`` or a tokenizer file; None
        samples token ids only (nothing is read).

    Returns:
      A `TextSampler` over the run's model, precision and mesh.
    """
    from experiments.lm.task import make_model

    if getattr(settings.repl.mesh, "shape", {}).get("stage", 1) > 1:
        raise ConfigError("sample runs no pipeline: give a mesh without a 'stage' axis")
    if settings.repl.mesh.shape.get("context", 1) > 1:
        raise ConfigError("sample splits no sequence: give a mesh without a 'context' axis")
    network = make_model(settings.model, None)
    loaded = None if tokenizer is None else _load_tokenizer(tokenizer)
    vocab = getattr(loaded, "vocab_size", None)
    if vocab is not None and vocab > network.vocab_size:
        raise ConfigError(
            f"the tokenizer {tokenizer!r} has {vocab} tokens, above the model's "
            f"vocab_size {network.vocab_size}"
        )
    sampler = Sampler(settings.repl.apply_policy(network), repl=settings.repl)
    return TextSampler(sampler, loaded)


def _load_tokenizer(spec: str) -> Any:
    from experiments.datasets.tokenizers import load_tokenizer

    return load_tokenizer(spec)


def cache_bytes_per_device(model: Any, repl: Any, batch: int, length: int, dtype: Any) -> int:
    """The bytes of a `KVCache` of ``batch`` rows and ``length`` slots on each device,
    split as `Sampler.state_shardings` splits it.

    >>> from experiments.lm.model import Transformer
    >>> import replicator as rp
    >>> repl = rp.Replicator(mesh={"data": 8})
    >>> cache_bytes_per_device(Transformer(num_layers=2, num_heads=4, embed_dim=32),
    ...                        repl, 8, 10, jnp.float32)
    5120
    """
    sharding = Sampler(model, repl=repl).state_shardings().cache.k
    layers, kv_heads, head_dim = kv_cache.cache_dims(model)
    shape = (layers, batch, length, kv_heads, head_dim)
    return 2 * math.prod(sharding.shard_shape(shape)) * np.dtype(dtype).itemsize
