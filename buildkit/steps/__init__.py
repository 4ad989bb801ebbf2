"""Step kinds. Each module registers its kinds in the one registry, ``REGISTRY``."""

from . import (  # noqa: F401  (registration)
    calibrate,
    eval,
    fetch,
    graft,
    publish,
    quantize,
    sanitize,
    sensitivity,
    verify,
)
from .base import REGISTRY, Step, get_step, register

__all__ = ["REGISTRY", "Step", "get_step", "register"]
