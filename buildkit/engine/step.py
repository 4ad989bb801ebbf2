"""The step plugin interface and the one registry every step kind lives in."""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from buildkit.core import workers
from buildkit.core.errors import UsageError, did_you_mean
from buildkit.store.artifact import Artifact
from buildkit.store.store import Store


class Params(BaseModel):
    """Base of every step's params: unknown fields are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class Slot:
    """A named input of a step. ``many`` slots take a list of node references."""

    required: bool = True
    many: bool = False


@dataclass
class BuildOptions:
    """Everything about one invocation that is *not* part of any cache key."""

    project_root: Path = field(default_factory=Path.cwd)
    out_dir: Path | None = None
    release: bool = False
    push: str | None = None
    rehash: bool = False
    dask: str | None = None  # a Dask scheduler address or local:N (``distributed.py``)
    remote: Any = None  # a remote.Remote: a local miss asks it (plan.Planner.lookup)


class Progress:
    """Counts a step reports while it runs; the scheduler renders them."""

    def __init__(self, node: str, sink=None):
        self.node, self.sink = node, sink
        self.done = self.total = self.bytes = 0
        self.unit = "tensors"
        self.lock = threading.Lock()

    def start(self, total: int, unit: str = "tensors") -> None:
        with self.lock:
            self.total, self.done, self.unit = total, 0, unit
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
    fingerprint: Any = None  # what ``Step.fingerprint`` gave for this run's key
    key: str | None = None  # this run's action key
    libraries: dict[str, str] = field(default_factory=dict)  # ``Step.libraries`` of this run
    executor: Any = None  # a ``distributed.DaskExecutor`` under ``build --dask``

    def map(
        self, fn: Callable, tasks: Iterable[tuple[str, tuple]], local_only: bool = False
    ) -> Iterator:
        """``fn(store, *args)`` for each task ``(name, args)``, results in task order: on two
        local threads, or (under ``build --dask``, unless ``local_only``) as Dask tasks named by
        the action key and ``name``. ``fn`` must be a top-level function and its results small
        (digests)."""
        if self.executor is None or local_only or self.key is None:
            return workers.imap("tensors", lambda t: fn(self.store, *t[1]), tasks, workers=2)
        return self.executor.map(fn, tasks, str(self.store.root), self.key, self.libraries)

    def out_path(self, template: str) -> Path:
        """Where a publishing step writes: ``--out`` if given, else ``template`` with
        ``{variant}`` filled in, relative to the project root."""
        p = self.options.out_dir or Path(template.format(variant=self.variant))
        return p if p.is_absolute() else self.options.project_root / p

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

    def key_params(self, params: Params, inputs: Mapping[str, list[Artifact]]) -> dict:
        """The params as they enter the key (all of them, defaults filled in). ``inputs`` are
        the input artifacts, for a step whose params mean something only against them (the
        quantizing steps resolve their rules to a per-tensor plan)."""
        return params.model_dump(mode="json")

    def fingerprint(self, params: Params, ctx: Context) -> Any:
        """Extra key ingredients observed outside the store (e.g. source file digests)."""
        return None

    def describe_fingerprint_change(self, old: Any, new: Any) -> str:
        return "fingerprint differs"

    def check_request(self, params: Params, ctx: Context) -> None:
        """Raise UsageError if this invocation cannot succeed (publish: an unusable output
        path), so the build fails before any step runs rather than after hours of work."""

    def outdated(self, params: Params, outputs: dict[str, Artifact], ctx: Context) -> str | None:
        """For steps with side effects: a reason to re-run despite a cache hit, or None."""
        return None

    def run(
        self, ctx: Context, params: Params, inputs: dict[str, list[Artifact]]
    ) -> dict[str, Artifact]:
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


REGISTRY: dict[str, type[Step]] = {}


def register(cls: type[Step]) -> type[Step]:
    if cls.kind in REGISTRY:
        raise RuntimeError(f"step kind {cls.kind!r} registered twice")
    REGISTRY[cls.kind] = cls
    return cls


def kinds() -> dict[str, type[Step]]:
    """Every registered kind. The built-in steps are plugins: they register themselves when
    ``buildkit.steps`` is imported, which this does by name so that no engine module imports
    a step (the layering runs engine -> steps, never back)."""
    importlib.import_module("buildkit.steps")
    return REGISTRY


def get_step(kind: str) -> Step:
    registry = kinds()
    try:
        return registry[kind]()
    except KeyError:
        raise UsageError(
            f"unknown step kind {kind!r}{did_you_mean(kind, registry)}; "
            f"known kinds: {', '.join(sorted(registry))}"
        ) from None


def library_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)
