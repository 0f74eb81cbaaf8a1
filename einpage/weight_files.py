"""Weights in safetensors files, read where they are: the public path of
`einpage.pipeline.weight_files` (`weight_places`, `save_weights`, `planned_weights`)."""

from einpage.pipeline.weight_files import *  # noqa: F403
from einpage.pipeline.weight_files import __all__  # noqa: F401
