"""A tiny Hugging Face checkpoint directory as the Hub serves one, made here offline: the
one docs/pretrained.md makes (`examples/post_training/tiny_llama.py`, loaded by path:
the examples are no package)."""

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "examples" / "post_training" / "tiny_llama.py"
_spec = importlib.util.spec_from_file_location("tiny_llama", _PATH)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

CHAT_TEMPLATE, SPECIALS, TEXTS = _module.CHAT_TEMPLATE, _module.SPECIALS, _module.TEXTS
write_tiny_llama, write_tokenizer = _module.write_tiny_llama, _module.write_tokenizer
