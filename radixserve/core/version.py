"""The package version (a leaf every floor may read)."""

__version__ = "0.1.0"
