"""What a ``source`` string names: a Hub repo, a generated or trained fixture, or a directory."""

from __future__ import annotations

import re

HF_RE = re.compile(r"^hf://(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<rev>[\w./-]+))?$")


PINNED = re.compile(r"^[0-9a-f]{40}$")


TRAINED = "fixture:trained"


def parse_fixture(source: str):
    from buildkit.fixtures.generated import FixtureSpec

    body = source[len("fixture:") :].strip("/")
    fields = {}
    for part in filter(None, body.split(",")):
        k, sep, val = part.partition("=")
        if not sep or not val.lstrip("-").isdigit():
            raise ValueError(
                f"fixture source takes name=integer pairs (or is {TRAINED}), got {part!r}"
            )
        fields[k.strip()] = int(val)
    return FixtureSpec(**fields)


def source_kind(source: str) -> str:
    if source.startswith("hf://"):
        return "hf"
    if source == TRAINED:
        return "trained"
    if source.startswith("fixture:"):
        return "fixture"
    return "local"
