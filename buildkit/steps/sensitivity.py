"""sensitivity: how much each routed-expert tensor's output error grows at each candidate bits.

Measured once per source and calibration (its key has the model, the calibration artifact,
which holds the text's digest, and these params, never a budget), so a new ``target_bpw``
re-plans quantize without re-measuring. The figures are in ``meta`` (no tensors); the proxy
is described in ``buildkit/budget.py``.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from .. import budget, workers
from .. import calibration as cal
from ..artifact import Artifact
from ..errors import StepError
from ..roles import BITS
from .base import Context, Params, Slot, Step, library_version, register


class SensitivityParams(Params):
    bits: list[int] = Field(default_factory=lambda: [3, 4, 6, 8])
    group_size: int = Field(default=64, ge=16)
    max_rows: int = Field(
        default=64, ge=1
    )  # output rows sampled per expert (the error is a sum over rows)

    @field_validator("bits")
    @classmethod
    def _bits(cls, v: list[int]) -> list[int]:
        if not v or any(b not in BITS for b in v):
            raise ValueError(f"bits must be a non-empty list of {', '.join(map(str, BITS))}")
        return sorted(set(v))


@register
class Sensitivity(Step):
    kind = "sensitivity"
    version = 1
    Params = SensitivityParams
    inputs = {"model": Slot(), "calibration": Slot()}  # sanitize:model, a calibrate output

    def libraries(self) -> dict[str, str]:
        return {name: library_version(name) for name in ("mlx", "numpy")}

    def run(self, ctx: Context, params: SensitivityParams, inputs) -> dict[str, Artifact]:
        model, calibration = inputs["model"][0], inputs["calibration"][0]
        names = [
            n
            for n in budget.routed_weights(model.tensors)
            if cal.stats_for(ctx.store, calibration, n.removesuffix(".weight")) is not None
        ]
        if not names:
            raise StepError(
                "sensitivity: no routed-expert weight has calibration statistics; "
                "point inputs.calibration at a calibrate step of this model"
            )
        ctx.progress.start(len(names))

        def work(name: str) -> tuple[str, dict[int, float]]:
            entry = model.tensors[name]
            importance, tokens = cal.stats_for(ctx.store, calibration, name.removesuffix(".weight"))
            if entry["shape"][-1] % params.group_size:
                raise StepError(
                    f"{name}: last dimension {entry['shape'][-1]} "
                    f"is not a multiple of group_size {params.group_size}"
                )
            return name, budget.measure(
                ctx.store,
                entry,
                importance,
                tokens,
                params.bits,
                params.group_size,
                params.max_rows,
            )

        figures = {}
        for name, s in workers.imap("tensors", work, names, workers=2):
            figures[name] = {str(b): v for b, v in s.items()}
            ctx.progress.advance(1)
        out = Artifact(
            meta={
                "proxy": budget.PROXY,
                "bits": params.bits,
                "group_size": params.group_size,
                "tensors": dict(sorted(figures.items())),
            }
        )
        ctx.log(f"sensitivity of {len(figures)} routed-expert tensors at bits {params.bits}")
        return {"out": out}
