"""forerun: lossless speculative decoding. `forerun.Engine` is the entry point."""

from forerun.api import Completion, Engine, LoadConfig
from forerun.propose import SpecConfig
from forerun.sampling import SamplingConfig

__all__ = ["Completion", "Engine", "LoadConfig", "SamplingConfig", "SpecConfig"]
__version__ = "0.1.0"
