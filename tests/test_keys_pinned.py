"""The key of every step kind, pinned as hex strings (redun's habit): an accidental change to what
enters a key fails here, by name.

Keys hold the versions of the libraries that change bytes, so they hold for the versions in
constraints.txt (what make installs and the release locks were made with); with others the
test says so and skips. A deliberate change (a step version bump, new params) updates these
strings together with the release locks (`make release`).
"""

from __future__ import annotations

import json
from importlib.metadata import version

import pytest
from conftest import REPO

from buildkit.engine.step import kinds

PINNED = {  # kind: (variant, node, key)
    "fetch": ("xl", "fetch", "xxh3_128:d8c66f549e3f38a5fda93ce1c13603e6"),
    "sanitize": ("xl", "sanitize", "xxh3_128:36d3e37a47e5e53ae1a880dd0babd2f3"),
    "quantize": ("xl", "quantize", "xxh3_128:93953489f377ad04f1443fedb5baaaa4"),
    "verify": ("xl", "verify", "xxh3_128:54afec8f29f87a20b1df405f2e0c9e7f"),
    "eval": ("xl", "eval", "xxh3_128:1e480aa1ac83a74bbfcba58f2c6612d9"),
    "publish": ("xl", "publish", "xxh3_128:f9be88bde511d883d6c4834ab7901633"),
    "graft": ("xl-mtp", "graft", "xxh3_128:20d6bacd0ead79548a85fcde403ec078"),
    "requantize": ("xl-mtp", "requantize", "xxh3_128:de3a3e3ed07ef446a477175807904c2a"),
    "calibrate": ("oq4e-mtp-xl", "calibrate", "xxh3_128:86dea1898be128df9a9fcb60e08db174"),
    "sensitivity": ("oq-budget", "sensitivity", "xxh3_128:bf13e4104f7d0311a69fcabeec7f835c"),
}


def pins() -> dict[str, str]:
    out = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, v = line.split("==")
            out[name.strip()] = v.strip()
    return out


def test_every_step_kind_is_pinned():
    assert set(PINNED) == set(kinds())


def test_keys_of_the_default_variants_are_pinned(project, seed):
    differ = {n: (v, version(n)) for n, v in pins().items() if version(n) != v}
    if differ:
        pytest.skip(f"library versions differ from constraints.txt: {differ}")
    project.adopt(seed)
    project.build("oq4e-mtp-xl")
    project.run("build", "oq-budget", "--target", "sensitivity")  # its budget is for the real model
    got = {}
    for kind, (variant, node, _) in PINNED.items():
        ref = json.loads((project.store / "refs" / f"{variant}.json").read_text())
        assert ref["nodes"][node]["ingredients"]["kind"] == kind
        got[kind] = ref["nodes"][node]["key"]
    assert got == {kind: key for kind, (_, _, key) in PINNED.items()}
