"""steps: one module per step kind; each registers its kinds in ``engine.step.REGISTRY``.

May import every layer but cli. A step never imports another step's module: what two steps
share lives in the layer below.
"""

from . import (  # noqa: F401  (registration)
    calibrate,
    eval,
    fetch,
    graft,
    publish,
    quantize,
    reference,
    sanitize,
    sensitivity,
    verify,
)
