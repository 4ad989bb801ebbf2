"""The step plugin interface and the one registry every step kind lives in."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
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


class Step:
    """A step kind: a pure function of (params, input artifacts) -> output artifacts.

    A step author sets five things and writes ``run``::

        class UpperParams(Params):
            suffix: str = "!"

        @register
        class Upper(Step):
            kind, version = "upper", 1  # bump version whenever the output bytes change
            Params = UpperParams
            inputs = {"model": Slot()}  # manifest: inputs.model = "sanitize"

            def run(self, ctx, params, inputs):
                model = inputs["model"][0]
                return {"out": Artifact(tensors=model.tensors, meta={"suffix": params.suffix})}

    Everything that changes the output bytes must be in the key: the params (``key_params``,
    all of them by default), the input artifacts, ``libraries()`` and ``reads()`` (files
    outside the store, such as a calibration text, by content). The hooks below the line are
    for the two steps that touch the world: fetch (a source tree) and publish (a directory).
    """

    kind: ClassVar[str]
    version: ClassVar[int]
    Params: ClassVar[type[Params]] = Params
    inputs: ClassVar[dict[str, Slot]] = {}
    outputs: ClassVar[tuple[str, ...]] = ("out",)
    uses_recipe: ClassVar[bool] = False  # params get the manifest's recipe as params.recipe

    def run(
        self, ctx: Context, params: Params, inputs: dict[str, list[Artifact]]
    ) -> dict[str, Artifact]:
        raise NotImplementedError

    def reads(self, params: Params, ctx: Context) -> dict[str, Path]:
        """Files outside the store this step reads, by name: their content digests enter the
        key, a change reruns the step ("source changed: <name>"), and a no-op
        build checks their stat (``uptodate``)."""
        return {}

    def key_params(self, params: Params, inputs: Mapping[str, list[Artifact]]) -> dict:
        """The params as they enter the key (all of them, defaults filled in; leave out a
        path that ``reads`` covers by content). ``inputs`` are the input artifacts, for params
        that mean something only against them (quantize resolves rules to a per-tensor plan)."""
        return params.model_dump(mode="json")

    def libraries(self) -> dict[str, str]:
        """Versions of libraries that change this step's output bytes (part of the key)."""
        return {}

    def check_request(self, params: Params, ctx: Context) -> None:
        """Raise UsageError if this invocation cannot succeed (publish: an unusable output
        path), so the build fails before any step runs rather than after hours of work."""

    # ---- for steps that touch the world (fetch, publish); ``register`` checks the pairing

    def fingerprint(self, params: Params, ctx: Context) -> Any:
        """Key ingredients observed outside the store; by default the digests of ``reads``."""
        files = self.reads(params, ctx)
        if not files:
            return None
        digest = ctx.store.sources.digest_file
        return {name: digest(path, rehash=ctx.options.rehash) for name, path in files.items()}

    def describe_fingerprint_change(self, old: Any, new: Any) -> str:
        """Which of the fingerprint's names changed, for the plan's reason."""
        old, new = old or {}, new or {}
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        more = f" (+{len(changed) - 5} more)" if len(changed) > 5 else ""
        return ", ".join(changed[:5]) + more

    def outdated(self, params: Params, outputs: dict[str, Artifact], ctx: Context) -> str | None:
        """For steps with side effects: a reason to re-run despite a cache hit, or None."""
        return None

    def watch(self, params: Params, ctx: Context) -> tuple[list[Path], list[Path]] | None:
        """Files outside the store this step reads and writes, whose stat vouches that a build
        that changed none of them would change nothing (``uptodate``); None if a stat cannot
        tell. By default what ``reads`` names."""
        return list(self.reads(params, ctx).values()), []


REGISTRY: dict[str, type[Step]] = {}
_plugins: list = []  # the entry points loaded, once


def register(cls: type[Step]) -> type[Step]:
    """Add a step kind to the registry (a class decorator)."""
    if cls.kind in REGISTRY:
        raise RuntimeError(f"step kind {cls.kind!r} registered twice")
    looks_outside = cls.fingerprint is not Step.fingerprint or cls.outdated is not Step.outdated
    if looks_outside and cls.watch is Step.watch:
        # uptodate would trust stats that say nothing of what the step looked at
        raise RuntimeError(
            f"step kind {cls.kind!r} overrides fingerprint or outdated: override watch too, "
            "naming the files those look at (or returning None if a stat cannot tell)"
        )
    REGISTRY[cls.kind] = cls
    return cls


def kinds() -> dict[str, type[Step]]:
    """Every registered kind. Steps are plugins: each ``buildkit.steps`` entry point (the
    built-in kinds' is in pyproject.toml) names a module that registers its kinds on import,
    so the engine never imports a step."""
    if not _plugins:
        plugins = _plugins[:] = entry_points(group="buildkit.steps")
        if not plugins:
            raise UsageError(
                "no step kinds are registered: buildkit is not installed "
                "(run `pip install -e .` in its checkout, or `make install`)"
            )
        for plugin in plugins:
            plugin.load()
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
