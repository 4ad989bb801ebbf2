"""Role rules: tensor path -> role -> {bits, group_size, mode} or passthrough.

A recipe is an ordered table of glob patterns (first match wins) naming a role
for every tensor, and a table of roles. It is data in the manifest, resolved
and validated when the manifest loads, and part of every quantizing step's key.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from buildkit.core.errors import StepError

BITS = (2, 3, 4, 5, 6, 8)


class Role(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    passthrough: bool = False
    bits: int | None = Field(default=None, ge=2, le=8)
    group_size: int = Field(default=64, ge=16)
    mode: Literal["affine"] = "affine"
    calibrated: bool = False  # data-aware scale search (needs calibration data)
    # how a calibrated role is quantized: dataaware.py's search, or gptq.py's error feedback
    method: Literal["search", "gptq"] = "search"
    # bits a bits-per-weight budget (recipe.target_bpw) may give this role's tensors, one each
    budget_bits: tuple[int, ...] | None = None

    @model_validator(mode="after")
    def _check(self):
        if not self.passthrough and self.bits is None:
            raise ValueError(
                "a role needs `bits` (and optionally group_size) or `passthrough = true`"
            )
        if self.passthrough and (self.bits is not None or self.calibrated):
            raise ValueError("a passthrough role takes no bits and is not calibrated")
        if self.method != "search" and not self.calibrated:
            raise ValueError(f"method = {self.method!r} needs calibrated = true (calibration data)")
        for b in (self.bits, *(self.budget_bits or ())):
            if b is not None and b not in BITS:
                raise ValueError(f"bits must be one of 2, 3, 4, 5, 6, 8 (mlx affine), got {b}")
        if self.budget_bits is not None:
            if (
                self.passthrough
                or len(self.budget_bits) < 2
                or list(self.budget_bits) != sorted(set(self.budget_bits))
            ):
                raise ValueError(
                    "budget_bits must list two or more distinct bits in increasing order, "
                    "on a quantized role (for example [3, 4, 6, 8])"
                )
        return self

    def key_dump(self) -> dict:
        """The role as it enters a quantizing step's key (budget_bits only when set, method only
        when not the default, so roles keep the keys they had before either existed)."""
        exclude = {"budget_bits"} if not self.budget_bits else set()
        if self.method == "search":
            exclude.add("method")
        return self.model_dump(mode="json", exclude=exclude or None)

    def quant(self) -> dict | None:
        return (
            None
            if self.passthrough
            else {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}
        )


class Recipe(BaseModel):
    """``rules``: pattern -> role name, in order, first match wins; ``roles``: name -> Role;
    ``target_bpw``: a bits-per-weight budget, spent on the roles with ``budget_bits`` by their
    measured sensitivity (``budget.py``; the quantizing step needs a ``sensitivity`` input)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    roles: dict[str, Role] = {}
    rules: dict[str, str] = {}
    target_bpw: float | None = Field(default=None, gt=1, le=32)

    @model_validator(mode="after")
    def _check(self):
        for pattern, role in self.rules.items():
            if role not in self.roles:
                raise ValueError(
                    f"rule {pattern!r} names role {role!r}, which is not in recipe.roles "
                    f"({', '.join(self.roles) or 'none'})"
                )
        return self

    def match(self, name: str) -> tuple[str, str] | None:
        """(pattern, role) of the first rule matching a tensor name or its module path."""
        module = name.removesuffix(".weight")
        for pattern, role in self.rules.items():
            if fnmatchcase(name, pattern) or fnmatchcase(module, pattern):
                return pattern, role
        return None

    def assign(self, names: list[str], require_all_rules: bool = True) -> dict[str, str]:
        """Role of every tensor name; errors for unassigned tensors and (optionally) dead rules."""
        out, unassigned, used = {}, [], set()
        for n in names:
            hit = self.match(n)
            if hit is None:
                unassigned.append(n)
            else:
                used.add(hit[0])
                out[n] = hit[1]
        if unassigned:
            more = f" (and {len(unassigned) - 5} more)" if len(unassigned) > 5 else ""
            raise StepError(
                f"no recipe rule matches tensor(s) {', '.join(unassigned[:5])}{more}; "
                "add a rule under [recipe.rules] (for example a passthrough role)"
            )
        if require_all_rules:
            dead = [p for p in self.rules if p not in used]
            if dead:
                raise StepError(
                    f"recipe rule(s) {', '.join(repr(p) for p in dead)} match no tensor; "
                    "fix the pattern or remove it (patterns are globs over names like "
                    "'language_model.model.layers.0.mlp.gate.weight')"
                )
        return out
