"""A base for tfds builders defined in this repository (nothing to download).

A builder of your own needs no base of ours: any `tfds.core.GeneratorBasedBuilder`
outside tfds' catalog is built where it is on first use
(`replicator.trainer.data.load_data_source`). This one only works around a tfds
4.9.10 packaging bug for builders that live in a package.
"""

import sys

import tensorflow_datasets as tfds
from etils import epath


class LocalBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """A `GeneratorBasedBuilder` whose code lives here rather than in tfds.

    tfds' default ``code_path`` (where it looks for ``checksums.tsv``) imports
    the ``importlib_resources`` backport for any builder that lives in a
    package, and tfds 4.9.10 does not depend on it for Python >= 3.9
    (tensorflow/datasets#11212). A builder that downloads nothing can point at
    its own module instead. With ``importlib_resources`` installed, or for a
    builder in a top-level module (a file beside your config), a plain
    ``GeneratorBasedBuilder`` needs none of this. Subclasses register with tfds
    under their snake_case name, as usual.
    """

    VERSION = tfds.core.Version("1.0.0")

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        return epath.Path(sys.modules[cls.__module__].__file__)
