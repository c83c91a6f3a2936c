"""Chat templates rendered as transformers renders them, and the assistant tokens they mark.

A checkpoint's chat template is a jinja program. transformers
(``PreTrainedTokenizerBase.apply_chat_template``, ``utils/chat_template_utils.py``)
runs it in jinja2's immutable sandbox with ``trim_blocks`` and ``lstrip_blocks``,
the ``loopcontrols`` extension, its own ``tojson`` filter (no HTML escaping), the
globals ``raise_exception``, ``strftime_now``, a ``dict`` and a ``namespace`` that
refuses underscore names, and the special tokens' strings (``bos_token``, ...) as
variables; ``{% generation %}...{% endgeneration %}`` blocks mark the characters
an assistant writes. `ChatTemplate` does the same with our own code, so its text
is transformers' text; `encode_chat` encodes it as ``apply_chat_template``
tokenizes (``add_special_tokens=False``) and marks assistant tokens:

* with ``{% generation %}`` marks: exactly ``return_assistant_tokens_mask=True``,
  every token whose characters overlap a marked span;
* without them (most templates on the Hub): each assistant turn's span is found by
  rendering prefixes: from the end of the conversation up to the turn rendered with
  ``add_generation_prompt=True`` (the assistant header) to the end of the
  conversation up to and including the turn. It marks the turn's content and the
  end-of-turn text the template writes after it (Llama 3's ``<|eot_id|>``,
  ChatML's ``<|im_end|>`` and its newline), as the generation marks in the usual
  templates do. A template that renders a prefix unlike the start of the whole
  conversation (one that drops earlier turns' reasoning, say) gets the part that
  agrees: the span starts and ends where the prefix and the whole part ways.

`ChatEncoder` turns rows of chat and preference data into ids and loss masks as TRL's
SFTTrainer and DPOTrainer do (`experiments.datasets.chat` says what each row becomes).
A template that uses ``strftime_now`` renders the day it runs, as in transformers.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import functools
import hashlib
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
import numpy as np

from experiments.datasets import tokenizers
from replicator.errors import DatasetError

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Message fields a reasoning trace goes by; templates read the first (transformers aliases them).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# What a template's Python can raise as it runs (a bad index, a filter on the wrong type).
_RENDER_ERRORS = (
    jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError,
    ArithmeticError, RecursionError,
)  # fmt: skip


class Rendering(NamedTuple):
    """A rendered conversation: its text and the ``(start, end)`` character spans of the
    assistant's parts in it."""

    text: str
    spans: tuple[tuple[int, int], ...]


class ChatTemplate:
    """A chat template, compiled once, that renders conversations as transformers does.

    Args:
      source: the template's jinja text.
      variables: the special tokens' strings it sees (``bos_token``, ...;
        `experiments.datasets.tokenizers.template_variables`).
      origin: where the template comes from, for error messages.

    Raises:
      DatasetError: ``source`` is not valid jinja.

    >>> template = ChatTemplate(
    ...     "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}"
    ...     "{% generation %}{{ m.content }}.{% endgeneration %}{% else %}{{ m.content }}"
    ...     "{% endif %}{% endfor %}", {"bos_token": "^"})
    >>> template.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    Rendering(text='^<user>hi<assistant>yo.', spans=((20, 23),))
    """

    def __init__(self, source: str, variables: Mapping[str, str] | None = None, origin: str = ""):
        self.source, self.origin = source, origin or "the chat template"
        self.variables = dict(variables or {})
        self.has_generation_marks = bool(_GENERATION_TAG.search(source))
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise DatasetError(
                f"{self.origin} is not a valid jinja template: {e.message} (line {e.lineno})"
            ) from None

    @property
    def digest(self) -> str:
        """A digest of what the template renders from: its text and its variables."""
        text = json.dumps([self.source, sorted(self.variables.items())])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Rendering:
        """Renders ``messages`` as ``apply_chat_template(..., tokenize=False)`` does.

        Args:
          messages: ``[{role, content, ...}]``; keys whose value is None are dropped and
            reasoning fields aliased, as transformers does.
          add_generation_prompt: end with the assistant's header.
          tools: JSON schemas of the tools, for templates that list them.
          template_kwargs: more variables (they win over the special tokens').

        Returns:
          The text and the spans its ``{% generation %}`` blocks wrote.

        Raises:
          DatasetError: the template fails on this conversation (its message, one line).
        """
        spans: list[tuple[int, int]] = []
        pieces: list[str] = []
        variables = {**self.variables, **(template_kwargs or {})}
        try:
            with _tracking(pieces, spans):
                for piece in self._template.generate(
                    messages=_normalized(messages), tools=tools, documents=None,
                    add_generation_prompt=add_generation_prompt, **variables,
                ):  # fmt: skip
                    pieces.append(piece)
        except _RENDER_ERRORS as e:
            reason = " ".join(str(e).split()) or type(e).__name__
            raise DatasetError(
                f"{self.origin} does not render this conversation: {reason}"
            ) from None
        return Rendering("".join(pieces), tuple(spans))

    def assistant_spans(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Rendering:
        """The conversation's text and its assistant spans: the ``{% generation %}`` blocks',
        or without them the turns found by rendering prefixes (the module docstring)."""
        options = {"tools": tools, "template_kwargs": template_kwargs}
        whole = self.render(messages, **options)
        if self.has_generation_marks:
            return whole
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            header = self.render(messages[:i], add_generation_prompt=True, **options).text
            through = self.render(messages[: i + 1], **options).text
            start, end = _agreeing(header, whole.text), _agreeing(through, whole.text)
            if end > start:
                spans.append((start, end))
        return Rendering(whole.text, tuple(spans))


class EncodedChat(NamedTuple):
    """A conversation's token ids (int32) and which of them are the assistant's (uint8)."""

    ids: np.ndarray
    assistant_mask: np.ndarray


def encode_chat(
    template: ChatTemplate,
    tokenizer: tokenizers.HuggingFaceTokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    tools: Sequence[Mapping] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> EncodedChat:
    """``apply_chat_template(messages, tokenize=True, return_assistant_tokens_mask=True)``:
    the rendered text encoded without added special tokens, and the assistant mask.

    Args:
      template: the chat template.
      tokenizer: an `experiments.datasets.tokenizers.HuggingFaceTokenizer` (it gives
        the characters of each token, ``encode_with_offsets``).
      messages: the conversation.
      add_generation_prompt: end with the assistant's header (a prompt); its mask is
        all zero.
      tools: the tools' JSON schemas, for templates that list them.
      template_kwargs: more template variables.

    Returns:
      The ids and their assistant mask (`EncodedChat`).
    """
    options = {"tools": tools, "template_kwargs": template_kwargs}
    if add_generation_prompt:
        rendering = template.render(messages, add_generation_prompt=True, **options)
        rendering = rendering._replace(spans=())
    else:
        rendering = template.assistant_spans(messages, **options)
    ids, offsets = tokenizer.encode_with_offsets(rendering.text)
    return EncodedChat(np.asarray(ids, np.int32), mask_tokens(offsets, rendering.spans))


def mask_tokens(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose characters ``[start, end)`` overlap one of ``spans`` (in
    order), as transformers turns generation spans into ``assistant_masks``.

    >>> mask_tokens([(0, 2), (2, 5), (5, 6), (6, 9)], [(3, 6)]).tolist()
    [0, 1, 1, 0]
    """
    if not len(offsets) or not spans:
        return np.zeros(len(offsets), np.uint8)
    starts, ends = np.asarray(offsets, np.int64).reshape(-1, 2).T
    span_starts, span_ends = np.asarray(spans, np.int64).reshape(-1, 2).T
    # transformers walks the spans and tokens together: each token meets the first span
    # that ends after the token starts, and is masked when it ends after that span starts.
    first = np.searchsorted(span_ends, starts, side="right")
    inside = first < len(spans)
    inside[inside] = ends[inside] > span_starts[first[inside]]
    return inside.astype(np.uint8)


def _agreeing(prefix: str, text: str) -> int:
    """How many leading characters ``prefix`` and ``text`` share."""
    if text.startswith(prefix):
        return len(prefix)
    return next((i for i, (a, b) in enumerate(zip(prefix, text)) if a != b), len(prefix))


def _normalized(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """The messages as transformers hands them to the template: None values dropped and a
    reasoning trace under every name templates read."""
    normalized = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


_TRACKED: contextvars.ContextVar = contextvars.ContextVar("generation_spans", default=None)


@contextlib.contextmanager
def _tracking(pieces: list[str], spans: list[tuple[int, int]]) -> Iterator[None]:
    token = _TRACKED.set((pieces, spans))
    try:
        yield
    finally:
        _TRACKED.reset(token)


class _GenerationMarks(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: records where the block's text lands in
    the output (after everything the template has yielded so far, as transformers counts)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_mark")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _mark(self, caller) -> str:
        text = caller()
        tracked = _TRACKED.get()
        if tracked is not None:
            pieces, spans = tracked
            start = sum(map(len, pieces))
            spans.append((start, start + len(text)))
        return text


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own filter escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


class _Dicts:
    """``dict(...)`` in a template, without the type itself (no attribute tricks on it)."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's ``namespace`` that refuses underscore names (a way out of the sandbox)."""

    def __init__(*args, **kwargs):  # jinja's own signature trick: ``namespace(self=...)`` works
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template cannot set the underscore name {name!r} on a namespace"
            )


@functools.cache
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationMarks, jinja2.ext.loopcontrols],
    )  # fmt: skip
    environment.filters["tojson"] = _tojson
    environment.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dicts(),
        namespace=_Namespace,
    )  # fmt: skip
    return environment


class Encoded(NamedTuple):
    """One row's sequences, ``(ids int32, loss_mask uint8)`` each (a conversation's one, a
    pair's chosen then rejected), and how many tokens they share at the start as the prompt
    (0 for a conversation)."""

    sequences: tuple[tuple[np.ndarray, np.ndarray], ...]
    prompt: int


class ChatEncoder:
    """Rows of chat or preference data -> token ids and loss masks, as TRL's trainers
    tokenize them (`experiments.datasets.chat` says what each kind of row becomes).

    Args:
      tokenizer: an `experiments.datasets.tokenizers.HuggingFaceTokenizer`.
      template: the chat template, or None (then rows of messages are an error).
      tokenizer_spec: the tokenizer's path as named, for messages and worker processes.
    """

    def __init__(
        self, tokenizer: tokenizers.HuggingFaceTokenizer, template: ChatTemplate | None,
        tokenizer_spec: str,
    ):  # fmt: skip
        self.tokenizer, self.template, self.tokenizer_spec = tokenizer, template, tokenizer_spec
        self.fingerprint = tokenizer.fingerprint
        eos = tokenizer.eos_id
        self.pad_id = next((i for i in (tokenizer.pad_id, eos) if i is not None), 0)
        self._eos_text = tokenizer.id_to_token(eos) if eos is not None else None
        self.template_digest = template.digest if template is not None else "none"

    @property
    def settings(self) -> tuple:
        """What `from_settings` rebuilds this encoder from in another process."""
        if self.template is None:
            return (self.tokenizer_spec, None, (), "")
        template = self.template
        return (
            self.tokenizer_spec,
            template.source,
            tuple(template.variables.items()),
            template.origin,
        )

    @classmethod
    def from_settings(cls, settings: tuple) -> ChatEncoder:
        """The encoder whose `settings` these are."""
        spec, source, variables, origin = settings
        template = None if source is None else ChatTemplate(source, dict(variables), origin)
        return cls(tokenizers.load_tokenizer(spec), template, spec)

    def encode(self, kind: str, row: Mapping[str, Any]) -> Encoded:
        """`conversation` for ``kind`` ``"chat"``, `pair` for ``"preferences"``."""
        return self.conversation(row) if kind == "chat" else self.pair(row)

    def conversation(self, row: Mapping[str, Any]) -> Encoded:
        """A chat row (``messages``, or ``prompt`` and ``completion``) as one sequence.

        Raises:
          DatasetError: the row is none of these, has no assistant turn or nothing to train.
        """
        options = _options(row)
        if "messages" in row:
            messages = _messages(row["messages"], "messages")
            _need_assistant(messages, "the conversation")
            ids, mask = self._chat(messages, options)
        elif "prompt" in row and "completion" in row:
            prompt, completion = row["prompt"], row["completion"]
            if isinstance(prompt, str) and isinstance(completion, str):
                ids = self._text(prompt + self._with_eos(completion))
                mask = _after(ids, self._text(prompt))
            else:
                prompt = _messages(prompt, "prompt")
                completion = _messages(completion, "completion")
                _need_assistant(completion, "the completion")
                ids, assistant = self._chat(prompt + completion, options)
                mask = assistant & _after(ids, self._chat(prompt, options, prompt=True)[0])
        else:
            raise DatasetError(
                f"a chat row needs 'messages', or 'prompt' and 'completion' (it has {sorted(row)})"
            )
        mask[:1] = 0
        if not mask.any():
            raise DatasetError(
                f"no token to train on: {self._template_origin()} marks none of the "
                "assistant's (or the completion is empty)"
            )
        return Encoded(((ids, mask),), 0)

    def pair(self, row: Mapping[str, Any]) -> Encoded:
        """A preference row (``prompt``, ``chosen``, ``rejected``; or TRL's implicit prompt)
        as its chosen and rejected sequences, which share the prompt's tokens.

        Raises:
          DatasetError: ``chosen`` or ``rejected`` is missing, the three are of mixed
            kinds, or a response has no token after the prompt.
        """
        if "chosen" not in row or "rejected" not in row:
            missing = [k for k in ("chosen", "rejected") if k not in row]
            raise DatasetError(
                f"a preference row needs 'chosen' and 'rejected'; it has no {missing}"
            )
        chosen, rejected = row["chosen"], row["rejected"]
        if "prompt" in row:
            prompt = row["prompt"]
        else:
            prompt, chosen, rejected = shared_prompt(chosen, rejected)
        if all(isinstance(part, str) for part in (prompt, chosen, rejected)):
            prompt_ids = self._text(prompt)
            sequences = [self._text(prompt + self._with_eos(r)) for r in (chosen, rejected)]
        elif not any(isinstance(part, str) for part in (prompt, chosen, rejected)):
            options = _options(row)
            prompt = _messages(prompt, "prompt")
            responses = [_messages(r, k) for r, k in ((chosen, "chosen"), (rejected, "rejected"))]
            prompt_ids = self._chat(prompt, options, prompt=True)[0]
            sequences = [self._chat(prompt + r, options)[0] for r in responses]
        else:
            raise DatasetError(
                "'prompt', 'chosen' and 'rejected' must be all strings or all messages"
            )
        shared = min(_common_prefix(prompt_ids, ids) for ids in sequences)
        for ids, name in zip(sequences, ("chosen", "rejected")):
            if len(ids) <= shared:
                raise DatasetError(f"'{name}' has no token after the prompt")
        masks = [_after_length(len(ids), shared) for ids in sequences]
        for mask in masks:
            mask[:1] = 0
        return Encoded(tuple(zip(sequences, masks)), shared)

    def _text(self, text: str) -> np.ndarray:
        # As TRL's tokenizer(text): the tokenizer.json's own special tokens (BOS) added.
        ids, _ = self.tokenizer.encode_with_offsets(text, add_special_tokens=True)
        return np.asarray(ids, np.int32)

    def _with_eos(self, text: str) -> str:
        eos = self._eos_text
        return text if eos is None or text.endswith(eos) else text + eos

    def _chat(self, messages: list[dict], options: dict, prompt: bool = False) -> EncodedChat:
        if self.template is None:
            raise DatasetError(
                f"tokenizer {self.tokenizer_spec} has no chat template (no chat_template.jinja "
                "beside it, none in its tokenizer_config.json) to render messages with; name "
                "one with template=PATH"
            )
        encoded = encode_chat(
            self.template, self.tokenizer, messages, add_generation_prompt=prompt, **options
        )
        return EncodedChat(encoded.ids, encoded.assistant_mask.copy())

    def _template_origin(self) -> str:
        return self.template.origin if self.template is not None else "the tokenizer"


def load_encoder(tokenizer: str, template: str | None = None) -> ChatEncoder:
    """The `ChatEncoder` of a Hugging Face tokenizer and its chat template (or ``template``'s).

    Args:
      tokenizer: a ``tokenizer.json`` or the directory holding it.
      template: a jinja file that wins over the tokenizer's own template.

    Raises:
      DatasetError: the tokenizer is not a tokenizer.json, or the template cannot be read
        or is not valid jinja.
      ConfigError: the tokenizer cannot be read.
    """
    loaded = tokenizers.load_tokenizer(tokenizer)
    if not isinstance(loaded, tokenizers.HuggingFaceTokenizer):
        raise DatasetError(
            f"chat and preference data need a Hugging Face tokenizer.json (the characters of "
            f"each token); tokenizer {tokenizer!r} is {loaded.fingerprint.split('-')[0]}"
        )
    found = tokenizers.find_chat_template(tokenizer, template)
    variables = tokenizers.template_variables(tokenizer)
    chat_template = None if found is None else ChatTemplate(found[0], variables, found[1])
    return ChatEncoder(loaded, chat_template, tokenizer)


def shared_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """TRL's implicit prompt (`trl.extract_prompt`): the messages (or characters) that
    ``chosen`` and ``rejected`` begin with, and what follows in each; a string's prompt
    leaves its last space to the responses.

    >>> shared_prompt("The sky is blue.", "The sky is green.")
    ('The sky is', ' blue.', ' green.')
    """
    if not isinstance(chosen, (str, list)) or type(chosen) is not type(rejected):
        raise DatasetError("'chosen' and 'rejected' must be both strings or both message lists")
    count = min(len(chosen), len(rejected))
    index = next((i for i in range(count) if chosen[i] != rejected[i]), count)
    if isinstance(chosen, str) and index > 0 and chosen[index - 1] == " ":
        index -= 1
    if isinstance(chosen, list) and index == 0:
        raise DatasetError("'chosen' and 'rejected' share no prompt; give the row a 'prompt'")
    return chosen[:index], chosen[index:], rejected[index:]


def _messages(value: Any, field: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise DatasetError(f"'{field}' must be a non-empty list of {{role, content}} messages")
    for message in value:
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), (str, list))
        ):
            raise DatasetError(
                f"each message of '{field}' needs a 'role' and a 'content': {message!r:.80}"
            )
    return value


def _need_assistant(messages: list[dict], what: str) -> None:
    if not any(message["role"] == "assistant" for message in messages):
        raise DatasetError(f"{what} has no assistant turn: nothing to train on")


def _options(row: Mapping[str, Any]) -> dict[str, Any]:
    """The ``tools`` and ``chat_template_kwargs`` a row gives its template (as TRL reads them)."""
    tools, kwargs = row.get("tools"), row.get("chat_template_kwargs") or {}
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise DatasetError(
                "'tools' must be a list of JSON schemas (or its JSON text)"
            ) from None
    if (tools is not None and not isinstance(tools, list)) or not isinstance(kwargs, dict):
        raise DatasetError(
            "'tools' must be a list of JSON schemas, 'chat_template_kwargs' an object"
        )
    return {"tools": tools, "template_kwargs": kwargs}


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    count = min(len(a), len(b))
    differ = np.flatnonzero(a[:count] != b[:count])
    return int(differ[0]) if len(differ) else count


def _after(ids: np.ndarray, prompt_ids: np.ndarray) -> np.ndarray:
    """1 for the tokens after those ``ids`` shares with ``prompt_ids`` (TRL's completion)."""
    return _after_length(len(ids), _common_prefix(prompt_ids, ids))


def _after_length(length: int, start: int) -> np.ndarray:
    mask = np.zeros(length, np.uint8)
    mask[start:] = 1
    return mask
