"""The installed package's version, for cache keys and the server's `/info` (a leaf: imports nothing of hf_spin)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("hf-spin")
except PackageNotFoundError:  # imported from a source tree that was not installed
    __version__ = "0.0.0+local"
