"""Language modelling: a GPT-2-shaped decoder on byte-level text, built offline.

``make_experiment`` is what the trainer calls (``config.experiment =
"experiments.lm"``), and ``CONFIG_KEYS`` the config keys it reads
(`experiments.lm.config`: tokenizer, packing, remat, pipeline, context and the
model's keys). Importing this package registers the ``python_stdlib`` and
``text_files`` tfds builders (`experiments.datasets.text`).
"""

import experiments.datasets.chat  # noqa: F401  (registers the chat and preference builders)
import experiments.datasets.text  # noqa: F401  (registers the text builders with tfds)
from experiments.datasets.tokenizer_export import write_tokenizer as write_tokenizer
from experiments.lm.config import CONFIG_KEYS as CONFIG_KEYS
from experiments.lm.harness import make_scorer as make_scorer
from experiments.lm.hf import hf_checkpoint as hf_checkpoint
from experiments.lm.model import Transformer as Transformer
from experiments.lm.model import count_params as count_params
from experiments.lm.sample import make_sampler as make_sampler
from experiments.lm.task import make_experiment as make_experiment
from experiments.lm.task import make_preprocess as make_preprocess
from experiments.lm.task import summarize as summarize
