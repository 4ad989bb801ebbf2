"""Fuzzing: generated manifests and safetensors headers never crash with an unhandled exception.

A manifest either loads (and its graph builds) or raises a ``BuildkitError``; a header is
either accepted, and then every tensor it names reads back with its declared shape, or
refused with a ``SourceError``.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
from conftest import REPO
from hypothesis import HealthCheck, given, settings

from buildkit.core.errors import BuildkitError, SourceError
from buildkit.engine import graph, manifest
from buildkit.engine.step import kinds
from buildkit.formats.tensors import DTYPES, read_header, read_tensor

# Fixed examples (derandomize) so CI is repeatable; no example database written into the tree.
SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# ---- manifests --------------------------------------------------------------------------

NAMES = [
    "fetch",
    "sanitize",
    "quantize",
    "verify",
    "publish",
    "graft",
    "requantize",
    "calibrate",
    "a",
    "b-1",
    "x.y",
    "bad name",
    "",
    "../up",
]
OUTPUTS = ["", ":out", ":model", ":mtp", ":heldout", ":nope", ":out:x"]
PARAMS = sorted(
    {f for cls in kinds().values() for f in cls.Params.model_fields}
    | {"recipe", "rules", "junk", "source"}
)
SOURCES = [
    "fixture:",
    "fixture:seed=1",
    "fixture:seed=x",
    "fixture:layers=-1",
    "fixture:bogus=1",
    "hf://a/b@main",
    "hf://a",
    "hf://../..@x",
    "/nonexistent",
    "",
    "../src",
]

scalars = st.one_of(
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(SOURCES),
    st.sampled_from(["*.mlp.gate", "*norm*", "keep", "router"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.sampled_from(PARAMS + ["bits", "group_size", "passthrough"]), inner, max_size=3
        ),
    ),
    max_leaves=8,
)
roles = st.dictionaries(
    st.sampled_from(["router", "keep", "routed_expert", "x"]),
    st.one_of(
        st.fixed_dictionaries(
            {},
            optional={
                "bits": st.integers(0, 9) | values,
                "group_size": st.sampled_from([16, 32, 64, 7, 0]),
                "passthrough": st.booleans(),
                "calibrated": st.booleans(),
                "mode": st.just("affine"),
            },
        ),
        values,
    ),
    max_size=3,
)
recipes = st.fixed_dictionaries(
    {},
    optional={
        "roles": roles | values,
        "rules": st.dictionaries(
            st.sampled_from(["*.mlp.gate", "*norm*", "vision_tower.*", "["]),
            st.sampled_from(["router", "keep", "nope"]) | values,
            max_size=3,
        ),
        "junk": values,
    },
)
refs = st.builds(lambda n, o: n + o, st.sampled_from(NAMES), st.sampled_from(OUTPUTS))
steps = st.fixed_dictionaries(
    {},
    optional={
        "kind": st.sampled_from(sorted(kinds()) + ["quantise", ""]) | values,
        "inputs": st.dictionaries(
            st.sampled_from(
                ["model", "source", "head", "trunk", "report", "base", "calibration", "nope"]
            ),
            refs | st.lists(refs, max_size=3) | values,
            max_size=3,
        ),
        "params": st.dictionaries(st.sampled_from(PARAMS), values | recipes, max_size=3),
        "junk": values,
    },
)
wild = st.fixed_dictionaries(
    {},
    optional={
        "extends": st.sampled_from(["xl", "xl-mtp", "oq4e-mtp-xl", "fuzz", "nope", "../x", ""])
        | values,
        "description": st.text(max_size=8) | values,
        "source": st.sampled_from(SOURCES) | values,
        "recipe": recipes | values,
        "steps": st.dictionaries(st.sampled_from(NAMES), steps | values, max_size=4) | values,
        "junk": values,
    },
)
# A real manifest with one or two things changed, so that validation gets past the first check.
HOT = [
    "recipe",
    "rules",
    "source",
    "text",
    "out",
    "max_rel_l1",
    "max_shard_bytes",
    "require_all_rules",
    "tags",
]
overrides = st.one_of(
    st.fixed_dictionaries(
        {
            "params": st.dictionaries(
                st.sampled_from(HOT) | st.sampled_from(PARAMS),
                values | recipes,
                min_size=1,
                max_size=1,
            )
        }
    ),
    st.fixed_dictionaries(
        {
            "inputs": st.dictionaries(
                st.sampled_from(["model", "source", "head", "report", "calibration"]),
                refs | st.lists(refs, max_size=2),
                min_size=1,
                max_size=1,
            )
        }
    ),
    st.fixed_dictionaries({"kind": st.sampled_from(sorted(kinds()))}),
)
tame = st.fixed_dictionaries(
    {"extends": st.sampled_from(["xl", "xl-mtp", "oq4e-mtp-xl"])},
    optional={
        "source": st.sampled_from(SOURCES),
        "recipe": recipes,
        "steps": st.dictionaries(
            st.sampled_from(NAMES[:8] + ["donor_fetch", "extra"]), overrides, min_size=1, max_size=2
        ),
    },
)
manifests = tame | wild


def toml_key(k: str) -> str:
    return json.dumps(k, ensure_ascii=False)


def toml_value(v) -> str:
    """TOML for a JSON-like value (inline tables and arrays); None becomes an empty table."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return (
            "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
        )
    if isinstance(v, int):
        return str(v)  # out-of-range integers are a TOML error, which is fine
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    items = v.items() if isinstance(v, dict) else []
    return "{" + ", ".join(f"{toml_key(k)} = {toml_value(x)}" for k, x in items) + "}"


def toml(d: dict) -> str:
    return "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in d.items())


def load_or_refuse(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for p in (REPO / "manifests").glob("*.toml"):
            shutil.copy(p, d)
        (d / "fuzz.toml").write_text(text)
        try:
            graph.build(manifest.load("fuzz", d))
        except BuildkitError:
            pass


@SETTINGS
@given(manifests)
def test_generated_manifests_load_or_raise_buildkit_errors(d):
    load_or_refuse(toml(d))


@settings(SETTINGS, max_examples=60)
@given(st.text(max_size=200))
def test_arbitrary_text_manifests_load_or_raise_buildkit_errors(text):
    load_or_refuse(text)


# ---- safetensors headers ----------------------------------------------------------------

ints = st.one_of(
    st.integers(0, 64), st.integers(-5, 2**64), st.booleans(), st.floats(0, 10), st.text(max_size=2)
)
shapes = st.lists(st.integers(0, 6), max_size=3) | st.lists(ints, max_size=3) | ints
dtypes = (
    st.sampled_from(sorted(DTYPES))
    | st.sampled_from(["bf16", "F8", "", "BF16 "])
    | st.lists(st.integers(), max_size=1)
    | st.none()
)
entries = (
    st.fixed_dictionaries(
        {},
        optional={
            "dtype": dtypes,
            "shape": shapes,
            "data_offsets": st.lists(ints, min_size=0, max_size=3) | ints,
            "junk": st.integers(),
        },
    )
    | ints
)
metadata = (
    st.dictionaries(st.text(max_size=4), st.text(max_size=4) | ints, max_size=2) | ints | st.none()
)


@st.composite
def headers(draw) -> bytes:
    """Mostly well-formed headers (offsets laid out from the shapes), with one thing broken."""
    head: dict = {}
    off = 0
    for name in draw(st.lists(st.text(max_size=8), max_size=4, unique=True)):
        if draw(st.booleans()):
            dtype, shape = (
                draw(st.sampled_from(sorted(DTYPES))),
                draw(st.lists(st.integers(0, 6), max_size=3)),
            )
            n = DTYPES[dtype].itemsize * int(np.prod(shape, dtype=np.int64))
            head[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
            off += n
        else:
            head[name] = draw(entries)
    if draw(st.booleans()):
        head["__metadata__"] = draw(metadata)
    blob = json.dumps(head).encode()
    data = b"\0" * draw(st.sampled_from([off, max(off - 1, 0), off + 7, 0]))
    hlen = draw(
        st.sampled_from([len(blob), len(blob) + 1, max(len(blob) - 1, 0), 2**64 - 1, 2**40])
    )
    return struct.pack("<Q", hlen) + blob + data


raw = st.one_of(
    headers(),
    st.binary(max_size=64),
    st.builds(lambda b: struct.pack("<Q", len(b)) + b, st.binary(max_size=64)),
    st.builds(lambda t: struct.pack("<Q", len(t.encode())) + t.encode(), st.text(max_size=64)),
    st.builds(
        lambda n: struct.pack("<Q", 2 * n + 2) + b"[" * (n + 1) + b"]" * (n + 1),
        st.integers(0, 200_000),
    ),
)


@settings(SETTINGS, max_examples=250)
@given(raw)
def test_safetensors_headers_are_accepted_or_refused_with_source_errors(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.safetensors"
        path.write_bytes(data)
        try:
            h = read_header(path)
        except SourceError:
            return
        for info in h.tensors.values():
            arr = read_tensor(info, path)
            assert arr.shape == info.shape and arr.dtype == DTYPES[info.dtype]
