"""The LM's side of ``python -m replicator eval --tasks``: log-likelihoods and greedy text.

`make_scorer` is the LM experiment's hook for lm-eval-harness
(`replicator.trainer.harness`, which turns lm_eval's requests into the calls below).
A `Scorer` holds the run's model on its mesh and the tokenizer, and answers two
kinds of question about token ids:

* `Scorer.loglikelihoods`: for ``(context, continuation)`` pairs, the continuation's
  log-probability and whether greedy decoding would produce it. The pairs are sorted
  by length, cut into batches of a fixed number of rows (``batch_size``, split over
  the data axes; short batches filled with rows that count for nothing) and
  right-padded to a length bucket (a power of two, at most the model's context), so
  that a handful of programs compile however many requests there are.
* `Scorer.generate`: greedy continuations with the KV-cache sampler
  (`experiments.lm.sample.Sampler`), in the same fixed batches with prompts
  left-padded to a bucket; a row ends at the tokenizer's end of document, or at a
  token whose text holds one of the stop strings (its text then holds the stop, so
  what follows is cut anyway), and the batch ends when every row has.

Tokenization is what lm_eval's Hugging Face backend (``--model hf``) does for the same
checkpoint directory: a ``tokenizer.json`` is loaded by transformers'
``AutoTokenizer`` from its directory where transformers is installed (lm_eval's HF
backend loads it so), else by the ``tokenizers`` library, whose ``encode`` adds the
special tokens of the file's post-processor as transformers' does. ``"bytes"``,
sentencepiece and tiktoken tokenizers add their ``bos_id`` where they have one.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lm.sample import SamplingOptions, left_pad, make_sampler
from replicator.errors import ConfigError

log = logging.getLogger("replicator")

_MIN_BUCKET = 16  # the shortest length bucket
_CHECK_EVERY = 8  # decode steps between looks at whether every row has stopped


def length_bucket(length: int, cap: int) -> int:
    """The padded length for sequences of up to ``length`` tokens: the next power of two
    from `_MIN_BUCKET` on, at most ``cap`` (and never below ``length``).

    >>> length_bucket(5, 64), length_bucket(17, 64), length_bucket(50, 40), length_bucket(9, 8)
    (16, 32, 50, 9)
    """
    bucket = max(_MIN_BUCKET, 1 << max(length - 1, 0).bit_length())
    return max(length, min(bucket, cap))


class HarnessTokenizer:
    """Text to ids as lm_eval's Hugging Face backend does it, and back.

    Args:
      backend: a transformers tokenizer, a ``tokenizers.Tokenizer`` or one of
        `experiments.datasets.tokenizers`' (``encode(text)`` without special tokens).
      eos_id, bos_id: its end and start of document (None: none).
      stop_ids: every id that ends a generation (``eos_id`` and a checkpoint's
        ``generation_config.json`` ones).
    """

    def __init__(self, backend: Any, eos_id: int | None, bos_id: int | None,
                 stop_ids: Sequence[int] = ()):  # fmt: skip
        self.backend, self.eos_id, self.bos_id = backend, eos_id, bos_id
        self.stop_ids = tuple(sorted({*stop_ids, *(() if eos_id is None else (eos_id,))}))
        self._kind = _kind_of(backend)
        self.vocab_size = _vocab_size(backend, self._kind)

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """``text``'s ids; ``add_special_tokens`` None: the tokenizer's default (with them)."""
        add = add_special_tokens is not False
        if self._kind == "transformers":
            return list(self.backend.encode(text, add_special_tokens=add))
        if self._kind == "tokenizers":
            return list(self.backend.encode(text, add_special_tokens=add).ids)
        ids = list(self.backend.encode(text))
        return [self.bos_id, *ids] if add and self.bos_id is not None else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (special tokens left out unless ``skip_special_tokens`` is False)."""
        ids = [int(i) for i in ids]
        if self._kind in ("transformers", "tokenizers"):
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if skip_special_tokens:
            ids = [i for i in ids if i not in (self.eos_id, self.bos_id)]
        return self.backend.decode(ids)

    @functools.lru_cache(maxsize=16)  # noqa: B019  (one tokenizer per command)
    def ids_holding(self, texts: tuple[str, ...]) -> tuple[int, ...]:
        """The ids whose own text holds one of ``texts``, and `stop_ids`."""
        texts = tuple(t for t in texts if t)
        pieces = self._pieces() if texts else ()
        holding = (i for i, piece in enumerate(pieces) if any(t in piece for t in texts))
        return tuple(sorted({*self.stop_ids, *holding}))

    @functools.cache  # noqa: B019
    def _pieces(self) -> list[str]:
        """Every token's own text, special tokens included."""
        singles = [[i] for i in range(self.vocab_size)]
        if self._kind == "transformers":
            return self.backend.batch_decode(singles, skip_special_tokens=False)
        if self._kind == "tokenizers":
            return self.backend.decode_batch(singles, skip_special_tokens=False)
        return [self.backend.decode(ids) for ids in singles]


def load_harness_tokenizer(spec: str) -> HarnessTokenizer:
    """The `HarnessTokenizer` of the config's ``tokenizer`` (``"bytes"`` or a local file).

    Raises:
      ConfigError: the file is missing or of no known kind (one line).

    >>> tokenizer = load_harness_tokenizer("bytes")
    >>> tokenizer.encode("hi"), tokenizer.eos_id, tokenizer.bos_id
    ([104, 105], 0, None)
    """
    from experiments.datasets.tokenizers import HuggingFaceTokenizer, load_tokenizer

    ours = load_tokenizer(spec)
    if not isinstance(ours, HuggingFaceTokenizer):
        return HarnessTokenizer(ours, ours.eos_id, ours.bos_id)
    path = os.path.expanduser(spec)
    stops = _generation_eos_ids(os.path.dirname(path))
    try:
        import transformers
    except ImportError:
        import tokenizers

        log.warning(
            "transformers is not installed: the tokenizer's special tokens come from %s's "
            "post-processor (lm_eval's HF backend, with transformers, may add others)", path
        )  # fmt: skip
        return HarnessTokenizer(tokenizers.Tokenizer.from_file(path), ours.eos_id, ours.bos_id,
                                stops)  # fmt: skip
    directory = os.path.dirname(path) or "."
    try:
        if not os.path.isfile(os.path.join(directory, "tokenizer_config.json")):
            backend = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
        else:
            backend = transformers.AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as e:  # a class transformers cannot make, a broken file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"transformers cannot load the tokenizer in {directory}: {first}"
        ) from None
    return HarnessTokenizer(backend, backend.eos_token_id, backend.bos_token_id, stops)


class Scorer:
    """The run's model on its mesh, asked lm_eval's questions in fixed batches.

    Args:
      sampler: the run's `experiments.lm.sample.Sampler` (model, precision, mesh).
      tokenizer: a `HarnessTokenizer`.
      batch_size: rows per program call (rounded up to split over the data axes).

    Attributes:
      traces: how many times each program was traced (``"score"``; the sampler's own
        ``traces`` count generation's).
    """

    def __init__(self, sampler: Any, tokenizer: HarnessTokenizer, batch_size: int):
        self.sampler, self.tokenizer = sampler, tokenizer
        unit = 1 if sampler.repl is None else sampler.repl.num_replicas
        self.batch_size = -(-max(batch_size, 1) // unit) * unit
        self.traces: collections.Counter = collections.Counter()
        self._score = self._compile_score()

    @property
    def max_length(self) -> int:
        """The model's context: a scored sequence and a prompt with its generation fit in it."""
        return self.sampler.max_len

    def loglikelihoods(
        self, params: Any, requests: Sequence[tuple[Sequence[int], Sequence[int]]]
    ) -> list[tuple[float, bool]]:
        """Each ``(context, continuation)``'s log-probability of the continuation after
        the context, and whether it is every position's argmax (greedy).

        Args:
          params: the model's parameters, on the run's mesh.
          requests: token ids; each context non-empty, each pair at most
            ``max_length + 1`` tokens (lm_eval's backends truncate contexts to fit).

        Returns:
          ``(logprob, is_greedy)`` per request, in order.
        """
        pairs = [(list(c), list(x)) for c, x in requests]
        bad = [i for i, (c, x) in enumerate(pairs) if not c or not x]
        if bad or any(len(c) + len(x) - 1 > self.max_length for c, x in pairs):
            raise ValueError(
                f"requests {bad[:4]} have no context or continuation, or a pair is longer than "
                f"max_length + 1 = {self.max_length + 1} tokens"
            )
        order = sorted(range(len(pairs)), key=lambda i: -sum(map(len, pairs[i])))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            arrays = self._score_batch([pairs[i] for i in rows])
            logprobs, greedy = jax.device_get(self._score(params, *self._place(arrays)))
            for row, i in enumerate(rows):
                results[i] = (float(logprobs[row]), bool(greedy[row]))
        return results

    def _score_batch(self, pairs: list[tuple[list[int], list[int]]]):
        """Inputs, targets and the continuation's weights ``[batch_size, bucket]``, right-padded."""
        length = length_bucket(max(len(c) + len(x) - 1 for c, x in pairs), self.max_length)
        shape = (self.batch_size, length)
        inputs, targets = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
        weights = np.zeros(shape, np.float32)
        for row, (context, continuation) in enumerate(pairs):
            whole = context + continuation
            n = len(whole) - 1
            inputs[row, :n], targets[row, :n] = whole[:-1], whole[1:]
            weights[row, n - len(continuation) : n] = 1.0
        return inputs, targets, weights

    def _compile_score(self):
        module, policy = self.sampler.module, self.sampler.policy

        def score(params, inputs_BxT, targets_BxT, weights_BxT):
            self.traces["score"] += 1
            if policy is not None:
                params = policy.cast_to_compute(params)
            logits_BxTxV = module.apply({"params": params}, inputs_BxT).astype(jnp.float32)
            logprobs_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
            target_BxT = jnp.take_along_axis(logprobs_BxTxV, targets_BxT[..., None], -1)[..., 0]
            hit_BxT = jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT
            greedy_B = jnp.all(hit_BxT | (weights_BxT == 0), axis=-1)
            return jnp.sum(target_BxT * weights_BxT, axis=-1), greedy_B

        repl = self.sampler.repl
        if repl is None:
            return jax.jit(score)
        return repl.compile(score, out_shardings=repl.mirrored_sharding)

    def generate(
        self, params: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
        stop: Sequence[str] = (),
    ) -> list[list[int]]:  # fmt: skip
        """Greedy continuations of ``prompts`` (the argmax at every step, as HF's greedy
        search), each cut before its first stop token.

        Args:
          params: the model's parameters, on the run's mesh.
          prompts: token ids, each at most ``max_length - max_new_tokens`` long.
          max_new_tokens: tokens to generate at most.
          stop: strings that end a generation (the caller cuts the text at them; a row
            stops early at a token whose text holds one).

        Returns:
          The generated ids per prompt, in order, without the stop token that ended it.
        """
        stop_ids = self.tokenizer.ids_holding(tuple(stop))
        options = SamplingOptions(max_new_tokens=max_new_tokens, temperature=0,
                                  stop_ids=stop_ids)  # fmt: skip
        prompts = [list(p) for p in prompts]
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        out: list[list[int]] = [[] for _ in prompts]
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            tokens = self._generate_batch([prompts[i] for i in rows], params, options)
            stops = set(stop_ids)
            for row, i in enumerate(rows):
                ids = tokens[row].tolist()
                end = next((k for k, t in enumerate(ids) if t in stops), len(ids))
                out[i] = ids[:end]
        return out

    def _generate_batch(self, prompts: list[list[int]], params: Any, options: SamplingOptions):
        """The sampler's prefill and decode programs on ``batch_size`` rows left-padded to a
        length bucket (the sampler's own ``generate`` pads to the longest prompt, a
        program per length); returns the generated tokens ``[rows, steps]``."""
        longest = max(map(len, prompts))
        cap = max(self.max_length - options.max_new_tokens, 1)
        length = min(length_bucket(longest, cap), self.max_length - 1)
        new = self.sampler.check([[0] * length, *prompts], options)
        tokens_BxP, start_B = left_pad(prompts, self.batch_size)  # filler: the last prompt
        shift = length - tokens_BxP.shape[1]
        tokens_BxP = np.pad(tokens_BxP, ((0, 0), (shift, 0)))
        start_B = start_B + shift
        keys_B = jax.random.split(jax.random.key(0), self.batch_size)  # greedy: unused
        # The sampler's programs for a shape chosen here (see the docstring).
        prefill, decode = self.sampler._compiled(options, new, tokens_BxP.shape)
        state = prefill(params, *self._place((tokens_BxP, start_B)), keys_B)
        for step in range(1, new):
            if step % _CHECK_EVERY == 0 and bool(np.all(jax.device_get(state.done))):
                break
            state = decode(params, state)
        steps = int(jax.device_get(state.step))
        return np.asarray(jax.device_get(state.tokens))[:, :steps]

    def _place(self, arrays: tuple[np.ndarray, ...]) -> tuple[Any, ...]:
        """Host arrays (the same on every process) split over the data axes by rows."""
        repl = self.sampler.repl
        if repl is None:
            return tuple(jnp.asarray(a) for a in arrays)
        sharding = repl.batch_sharding
        return tuple(
            jax.make_array_from_callback(a.shape, sharding, lambda index, a=a: a[index])
            for a in arrays
        )


def make_scorer(settings: Any, tokenizer: str | None = "bytes", batch_size: int = 8) -> Scorer:
    """The LM experiment's lm-eval-harness hook (`replicator.trainer.harness`).

    Args:
      settings: the trainer's `replicator.trainer.Settings` (model keys, Replicator).
      tokenizer: the config's ``tokenizer``: ``"bytes"`` or a tokenizer file (for a
        Hugging Face checkpoint, its ``tokenizer.json``: lm_eval's HF backend encodes
        with the tokenizer of that directory).
      batch_size: rows per program call (the config's ``eval_batch_size``).

    Returns:
      A `Scorer` over the run's model, precision and mesh.

    Raises:
      ConfigError: no tokenizer, one larger than the model's vocabulary, or a model the
        sampler cannot decode (a pipeline, a context axis, experts): one line each.
    """
    if tokenizer is None:
        raise ConfigError("eval --tasks needs a tokenizer: set config.tokenizer")
    text = load_harness_tokenizer(tokenizer)
    sampler = make_sampler(settings, tokenizer=None).sampler
    if text.vocab_size > sampler.module.vocab_size:
        raise ConfigError(
            f"the tokenizer {tokenizer!r} has {text.vocab_size} tokens, above the model's "
            f"vocab_size {sampler.module.vocab_size}"
        )
    return Scorer(sampler, text, batch_size)


def _kind_of(backend: Any) -> str:
    module = type(backend).__module__
    if module.startswith("transformers"):
        return "transformers"
    if module.startswith("tokenizers"):
        return "tokenizers"
    return "ours"


def _vocab_size(backend: Any, kind: str) -> int:
    if kind == "transformers":
        return len(backend)
    if kind == "tokenizers":
        return backend.get_vocab_size(with_added_tokens=True)
    return backend.vocab_size


def _generation_eos_ids(directory: str) -> tuple[int, ...]:
    """The ``eos_token_id`` (one or a list) of ``generation_config.json`` in ``directory``:
    the tokens HF's ``generate`` stops at, beside the tokenizer's."""
    try:
        with open(os.path.join(directory, "generation_config.json")) as f:
            found = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return ()
    found = [found] if isinstance(found, int) else found
    return tuple(i for i in found or () if isinstance(i, int))
