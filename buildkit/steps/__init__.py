"""Step kinds. Each module registers its kinds in the one registry, ``REGISTRY``."""

from . import calibrate, fetch, graft, publish, quantize, sanitize, sensitivity, verify  # noqa: F401  (registration)
from .base import REGISTRY, Step, get_step, register

__all__ = ["REGISTRY", "Step", "get_step", "register"]
