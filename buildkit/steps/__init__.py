"""Step kinds. Each module registers its kinds in the one registry, ``REGISTRY``."""

from . import calibrate, eval, fetch, graft, publish, quantize, sanitize, verify  # noqa: F401  (registration)
from .base import REGISTRY, Step, get_step, register

__all__ = ["REGISTRY", "Step", "get_step", "register"]
