"""The peer the benches measure buildkit against: ``mlx_lm.convert`` at xl's routed-expert
recipe (6 bits, group size 64) for every weight, one command line for every bench."""

from __future__ import annotations

import sys
from pathlib import Path


def convert_argv(src: Path, out: Path, python: str = sys.executable) -> list:
    return [
        python,
        *("-m", "mlx_lm", "convert", "--hf-path", src, "--mlx-path", out),
        *("-q", "--q-bits", "6", "--q-group-size", "64"),
    ]
