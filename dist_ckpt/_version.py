"""The version of dist_ckpt, in one place that imports nothing: the package, the command line
(``dist-ckpt --version`` without importing torch) and the writer record of every checkpoint
(``storage.writer_record``) read it; CHANGELOG.md's newest entry matches it."""

__all__ = ["__version__"]

__version__ = "0.2.0"
