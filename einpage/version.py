"""The package version, in a leaf every room may import (the CLI prints it)."""

__version__ = "0.1.0"
