"""specgate: a Kubernetes operator and a speculation-aware router for SGLang EAGLE-3 serving.

The version is the installed package's (pyproject.toml is its one source); the default images
and the chart carry the same one (`scripts/release.py check`)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("specgate")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

SGLANG_VERSION = "0.5.17"
"""The SGLang release the worker image patches (worker-image/)."""

__all__ = ["SGLANG_VERSION", "__version__"]
