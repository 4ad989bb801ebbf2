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
                f"fixture source takes name=integer pairs (or is {TRAINED} or "
                f"{TRAINED}=NAME), got {part!r}"
            )
        fields[k.strip()] = int(val)
    return FixtureSpec(**fields)


def source_kind(source: str) -> str:
    if source.startswith("hf://"):
        return "hf"
    if source == TRAINED or source.startswith(TRAINED + "="):
        return "trained"
    if source.startswith("fixture:"):
        return "fixture"
    return "local"


def trained_name(source: str) -> str | None:
    """NAME of ``fixture:trained=NAME`` (None for ``fixture:trained``, the default); a
    ``ValueError`` listing the known names if there is no such trained fixture."""
    if source == TRAINED:
        return None
    from buildkit.fixtures.trained import FIXTURES

    name = source[len(TRAINED) + 1 :]
    if name not in FIXTURES:
        raise ValueError(
            f"no trained fixture {name!r} in {source!r}; the known ones: "
            + ", ".join(f"{TRAINED}={n} ({f.about})" for n, f in FIXTURES.items())
        )
    return name
