"""The package's version (one place: ``asynclock.__version__`` and the stats endpoint)."""

__version__ = "0.1.0.dev0"
