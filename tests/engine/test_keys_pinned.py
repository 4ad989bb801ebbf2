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
    "fetch": ("xl", "fetch", "xxh3_128:f7e38d65f514fc4b98ece075018e26f1"),
    "sanitize": ("xl", "sanitize", "xxh3_128:59759e2ade764d5b266ed1224d520f53"),
    "quantize": ("xl", "quantize", "xxh3_128:8e109f37a863a7674d45adb505863fd7"),
    "verify": ("xl", "verify", "xxh3_128:0b91178842c53f01beddd24353718b4a"),
    "reference": ("xl", "reference", "xxh3_128:4b380bbe7f892b5953a492ebc082fa62"),
    "eval": ("xl", "eval", "xxh3_128:ba21880cc119d6154aada5ae41dc9861"),
    "publish": ("xl", "publish", "xxh3_128:7ab57e546a503d66aa9a2a9cf4ab0079"),
    "graft": ("xl-mtp", "graft", "xxh3_128:795eecd020d2de0742c584a6b1df5df9"),
    "requantize": ("xl-mtp", "requantize", "xxh3_128:07926dc069fe99b39ca90a44c052fa0d"),
    "calibrate": ("oq4e-mtp-xl", "calibrate", "xxh3_128:fee2c7ed135548e38ea1944fd39d6a7e"),
    "sensitivity": ("oq-budget", "sensitivity", "xxh3_128:6d5781dd31d697e075cb45f169b2cf10"),
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
