"""A base for tfds builders defined in this repository (nothing to download)."""

import sys

import tensorflow_datasets as tfds
from etils import epath


class LocalBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """A `GeneratorBasedBuilder` whose code lives here rather than in tfds.

    tfds' default ``code_path`` (where it looks for ``checksums.tsv``) imports
    the ``importlib_resources`` backport for any builder that lives in a
    package, and tfds 4.9.10 does not depend on it for Python >= 3.9. A
    builder that downloads nothing can point at its own module instead.
    Subclasses register with tfds under their snake_case name, as usual.
    """

    VERSION = tfds.core.Version("1.0.0")

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        return epath.Path(sys.modules[cls.__module__].__file__)
