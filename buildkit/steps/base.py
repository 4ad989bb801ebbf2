"""The step plugin interface and the one registry every step kind lives in."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from ..artifact import Artifact
from ..errors import UsageError, did_you_mean
from ..store import Store


class Params(BaseModel):
    """Base of every step's params: unknown fields are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class Slot:
    """A named input of a step. ``many`` slots take a list of node references.

    A ``gate`` slot need not be ready for the step to start: a step with ``prepare`` may do
    the work that does not depend on it while the gate's producers still run (publish
    writes the model while verify checks it) and gets it, as usual, in ``run``.
    """

    required: bool = True
    many: bool = False
    gate: bool = False


@dataclass
class BuildOptions:
    """Everything about one invocation that is *not* part of any cache key."""

    project_root: Path = field(default_factory=Path.cwd)
    out_dir: Path | None = None
    release: bool = False
    push: str | None = None
    dry_run: bool = False
    rehash: bool = False


class Progress:
    """Counts a step reports while it runs; the scheduler renders them."""

    def __init__(self, node: str, sink=None):
        self.node, self.sink = node, sink
        self.done = self.total = self.bytes = 0
        self.lock = threading.Lock()

    def start(self, total: int) -> None:
        with self.lock:
            self.total, self.done = total, 0
        self._emit()

    def advance(self, n: int = 1, nbytes: int = 0) -> None:
        with self.lock:
            self.done += n
            self.bytes += nbytes
        self._emit()

    def _emit(self):
        if self.sink:
            self.sink(self)


@dataclass
class Context:
    """What a running step may use: the store, the invocation's options, progress and a log."""

    store: Store
    node: str
    variant: str
    options: BuildOptions
    progress: Progress
    log_sink: Any = None
    prepared: Any = None  # what ``Step.prepare`` returned, when the scheduler called it
    fingerprint: Any = None  # what ``Step.fingerprint`` gave for this run's key
    on_new_content: Any = None  # the scheduler's answer to ``new_content``

    def new_content(self, nbytes: int) -> None:
        """Say that this step is about to read ``nbytes`` of content the store has never seen
        (source files it must hash): the steps after it will most likely build something new."""
        if self.on_new_content is not None:
            self.on_new_content(nbytes)

    def log(self, msg: str) -> None:
        if self.log_sink:
            self.log_sink(self.node, msg)
        else:
            print(f"[{self.node}] {msg}", file=sys.stderr)


class Step:
    """A registered step kind: a pure function of (params, input artifacts) -> output artifacts.

    Subclasses set ``kind``, ``version`` (bump it whenever output bytes change),
    ``Params``, ``inputs`` and ``outputs`` and implement ``run``.
    """

    kind: ClassVar[str]
    version: ClassVar[int]
    Params: ClassVar[type[Params]] = Params
    inputs: ClassVar[dict[str, Slot]] = {}
    outputs: ClassVar[tuple[str, ...]] = ("out",)
    uses_recipe: ClassVar[bool] = False

    def libraries(self) -> dict[str, str]:
        """Versions of libraries that change this step's output bytes (part of the key)."""
        return {}

    def key_params(self, params: Params) -> dict:
        """The params as they enter the key (all of them, defaults filled in)."""
        return params.model_dump(mode="json")

    def fingerprint(self, params: Params, ctx: Context) -> Any:
        """Extra key ingredients observed outside the store (e.g. source file digests)."""
        return None

    def describe_fingerprint_change(self, old: Any, new: Any) -> str:
        return "fingerprint differs"

    def outdated(self, params: Params, outputs: dict[str, Artifact], ctx: Context) -> str | None:
        """For steps with side effects: a reason to re-run despite a cache hit, or None."""
        return None

    def run(self, ctx: Context, params: Params, inputs: dict[str, list[Artifact]]) -> dict[str, Artifact]:
        raise NotImplementedError

    def watch(self, params: Params, ctx: Context) -> tuple[list[Path], list[Path]] | None:
        """Files outside the store this step reads (inputs) and writes (outputs), whose stat
        vouches that a build that changed none of them would change nothing (``uptodate.py``);
        None if a stat cannot tell. A step that reads only its inputs watches nothing; one
        with a fingerprint or an ``outdated`` check looks outside and must say where."""
        own = type(self)
        if own.fingerprint is not Step.fingerprint or own.outdated is not Step.outdated:
            return None
        return [], []

    # Modules ``run`` imports that are slow to import (mlx_lm pulls in transformers: ~1.2 s).
    # Once a build runs its first step, the scheduler imports those of the steps after it on
    # a spare thread, while that step works (or its source is hashed, in a first build);
    # a build with nothing to do imports none.
    imports: ClassVar[tuple[str, ...]] = ()

    def imports_if_new(self, params: Params) -> tuple[str, ...]:
        """Slow imports ``run`` needs only for a model never built before (publish's load check:
        mlx_lm runs it once per model). The scheduler starts them when a step before this one
        reads enough new content (``Context.new_content``): a new source, while it is hashed
        and the disk, not the CPU, is the bound."""
        return ()

    # Optional, for steps with gate slots: start before the gates are ready.
    prepare: ClassVar[Any] = None  # (ctx, params, inputs without gate slots) -> handle for run

    def discard(self, prepared: Any) -> None:
        """Undo ``prepare`` when ``run`` will not be called (a gate failed, or a cache hit)."""


REGISTRY: dict[str, type[Step]] = {}


def register(cls: type[Step]) -> type[Step]:
    if cls.kind in REGISTRY:
        raise RuntimeError(f"step kind {cls.kind!r} registered twice")
    REGISTRY[cls.kind] = cls
    return cls


def get_step(kind: str) -> Step:
    try:
        return REGISTRY[kind]()
    except KeyError:
        raise UsageError(
            f"unknown step kind {kind!r}{did_you_mean(kind, REGISTRY)}; "
            f"known kinds: {', '.join(sorted(REGISTRY))}"
        ) from None


def library_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)
