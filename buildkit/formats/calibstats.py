"""How a calibration's statistics are named in its artifact, and read back: what calibrate
writes and the data-aware quantizers weigh with, without running anything."""

from __future__ import annotations

from buildkit.core.lazy import lazy
from buildkit.formats.checkpoint import SWITCH

np = lazy("numpy", __name__)


def stat_name(module: str) -> str:
    """Name of the importance tensor [E, in_features] of a routed-expert weight's module."""
    return f"{module}.input_sq_mean"


def tokens_name(layer: str) -> str:
    return f"{layer}{SWITCH}.tokens"


def stats_for(store, art, module: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(importance [E, in_features], routed tokens [E]) for ``<layer>.mlp.switch_mlp.<proj>``,
    or None if the calibration holds nothing for it."""
    layer, sep, _ = module.partition(SWITCH)
    entry, count = art.tensors.get(stat_name(module)), art.tensors.get(tokens_name(layer))
    if not sep or entry is None or count is None:
        return None
    return store.read_tensor(entry).astype(np.float32), store.read_tensor(count)
