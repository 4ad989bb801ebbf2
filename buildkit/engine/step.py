"""The step plugin interface and the one registry every step kind lives in."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

from buildkit.core import workers
from buildkit.core.errors import UsageError, did_you_mean
from buildkit.store.artifact import Artifact
from buildkit.store.store import Store


@dataclass(frozen=True)
class SameBytes:
    """Marks a Params field that does not change the output bytes, so it stays out of the key:
    ``out: Annotated[str, SameBytes()] = "out"``. With ``when``, only for params where
    ``when(params)`` holds (a field that means nothing unless another is set)."""

    when: Callable[[Any], bool] | None = None


@dataclass(frozen=True)
class Inherit:
    """Marks a Params field whose default the manifest fills in at load: from its top level
    (``top``: a value, or a table the step's own entries are deep-merged over) or from the same
    field of the step in input slot ``slot`` (else ``fallback``)."""

    top: str | None = None
    slot: str | None = None
    fallback: Any = None


def markers(params_cls: type[BaseModel], marker: type) -> dict[str, Any]:
    """field name -> its ``marker`` instance, for the fields of ``params_cls`` that carry one."""
    return {
        name: m
        for name, f in params_cls.model_fields.items()
        for m in f.metadata
        if isinstance(m, marker)
    }


class Params(BaseModel):
    """Base of every step's params: unknown fields are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def key_params(self, inputs: Mapping[str, list[Artifact]] | None = None) -> dict:
        """The params as they enter the key: every field, defaults filled in, but those marked
        ``SameBytes``. Override for params that mean something only against the input
        artifacts ``inputs`` (quantize resolves its rules to a per-tensor plan)."""
        drop = {
            name
            for name, m in markers(type(self), SameBytes).items()
            if m.when is None or m.when(self)
        }
        return self.model_dump(mode="json", exclude=drop)


@dataclass(frozen=True)
class Slot:
    """A named input of a step. ``many`` slots take a list of node references."""

    required: bool = True
    many: bool = False


class Step:
    """A step kind: a pure function of (params, input artifacts) -> output artifacts.

    A step author sets ``kind``, ``version``, ``Params``, ``inputs`` and ``outputs`` and writes
    ``run``; per-tensor work goes through ``ctx.map`` (local threads, or Dask tasks under
    ``build --dask``), whose task is a top-level function of the store that returns an entry::

        from typing import Annotated

        from buildkit.engine.step import Params, SameBytes, Slot, Step, register
        from buildkit.formats.tensors import from_float32, to_float32
        from buildkit.store.artifact import Artifact


        def scaled(store, entry, factor):  # a task: reads one tensor, writes one object
            x = to_float32(store.read_tensor(entry), entry["dtype"]) * factor
            return store.put_tensor(entry["dtype"], from_float32(x, entry["dtype"]))


        class ScaleParams(Params):
            factor: float = 2.0
            label: Annotated[str, SameBytes()] = ""  # a name for people: not in the key


        @register
        class Scale(Step):
            kind, version = "scale", 1  # bump version whenever the output bytes change
            Params = ScaleParams
            inputs = {"model": Slot()}  # manifest: inputs = { model = "sanitize:model" }
            outputs = ("out",)

            def run(self, ctx, params, inputs):
                norms = {
                    n: e for n, e in inputs["model"][0].tensors.items() if n.endswith("norm.weight")
                }
                tasks = [(n, (e, params.factor)) for n, e in sorted(norms.items())]
                out = dict(zip(sorted(norms), ctx.map(scaled, tasks)))
                return {"out": Artifact(tensors=out, meta={"label": params.label})}

    Everything that changes the output bytes must be in the key: the params (every field but
    those marked ``SameBytes``; ``Params.key_params`` for more), the input artifacts,
    ``libraries()`` and ``reads()`` (files outside the store, such as a text, by content). A
    built-in kind is imported in ``buildkit/steps/__init__.py``; a kind of one's own package is
    found through its ``buildkit.steps`` entry point (docs/develop.md). What only some steps
    need is elsewhere: ``WorldStep`` for steps that watch the outside world (fetch, publish, eval),
    and the hooks ``ChecksRequest``, ``ReleaseGate``, ``Estimates``, ``SharesResource`` and
    ``Publishes``.
    """

    kind: ClassVar[str]
    version: ClassVar[int]
    Params: ClassVar[type[Params]] = Params
    inputs: ClassVar[dict[str, Slot]] = {}
    outputs: ClassVar[tuple[str, ...]] = ("out",)

    def run(
        self, ctx: Context, params: Params, inputs: dict[str, list[Artifact]]
    ) -> dict[str, Artifact]:
        raise NotImplementedError

    def reads(self, params: Params, ctx: Context) -> dict[str, Path]:
        """Files outside the store this step reads, by name: their content digests enter the
        key, a change reruns the step ("source changed: <name>"), and a no-op
        build checks their stat (``uptodate``)."""
        return {}

    def libraries(self) -> dict[str, str]:
        """Versions of libraries that change this step's output bytes (part of the key)."""
        return {}


def read_digests(step: Step, params: Params, ctx: Context) -> dict[str, str] | None:
    """The content digests of what ``step.reads`` names (None if it names nothing)."""
    files = step.reads(params, ctx)
    if not files:
        return None
    digest = ctx.store.sources.digest_file
    return {name: digest(path, rehash=ctx.options.rehash) for name, path in files.items()}


class WorldStep(Step):
    """A step that watches the outside world beyond ``reads`` (fetch: a source tree; publish:
    a directory it wrote). It must say which files a stat can vouch for (``watch``)."""

    def fingerprint(self, params: Params, ctx: Context) -> Any:
        """Key ingredients observed outside the store; by default the digests of ``reads``."""
        return read_digests(self, params, ctx)

    def describe_fingerprint_change(self, old: Any, new: Any) -> str:
        """Which of the fingerprint's names changed, for the plan's reason."""
        return changed_names(old, new)

    def outdated(self, params: Params, outputs: dict[str, Artifact], ctx: Context) -> str | None:
        """A reason to re-run despite a cache hit (the world changed under it), or None."""
        return None

    def watch(self, params: Params, ctx: Context) -> tuple[list[Path], list[Path]] | None:
        """Files outside the store this step reads and writes, whose stat vouches that a build
        that changed none of them would change nothing (``uptodate``); None if a stat cannot
        tell."""
        raise NotImplementedError


def changed_names(old: Any, new: Any) -> str:
    """Which names of two fingerprints (dicts) differ, the first five."""
    old, new = old or {}, new or {}
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    more = f" (+{len(changed) - 5} more)" if len(changed) > 5 else ""
    return ", ".join(changed[:5]) + more


# What the engine asks of any step, a WorldStep or not.


def fingerprint(step: Step, params: Params, ctx: Context) -> Any:
    if isinstance(step, WorldStep):
        return step.fingerprint(params, ctx)
    return read_digests(step, params, ctx)


def describe_fingerprint_change(step: Step, old: Any, new: Any) -> str:
    if isinstance(step, WorldStep):
        return step.describe_fingerprint_change(old, new)
    return changed_names(old, new)


def outdated(step: Step, params: Params, outputs: dict[str, Artifact], ctx: Context) -> str | None:
    return step.outdated(params, outputs, ctx) if isinstance(step, WorldStep) else None


def watch(step: Step, params: Params, ctx: Context) -> tuple[list[Path], list[Path]] | None:
    if isinstance(step, WorldStep):
        return step.watch(params, ctx)
    return list(step.reads(params, ctx).values()), []


@runtime_checkable
class ChecksRequest(Protocol):
    """A step that can tell before any step runs that an invocation cannot succeed."""

    def check_request(self, params: Params, ctx: Context) -> None:
        """Raise UsageError (publish: an unusable output path), so the build fails before
        hours of work rather than after."""


@runtime_checkable
class ReleaseGate(Protocol):
    """A step whose outputs a release must meet (eval: figures within limits). The release
    code asks it of every node, cached or run: a gate never makes a node stale."""

    def release_gate(self, params: Params, outputs: dict[str, Artifact]) -> list[str]:
        """What the outputs fail, one line each (empty: the release may go on)."""


@runtime_checkable
class Estimates(Protocol):
    """A step that can say, from layouts alone (no tensor data), what it would output:
    ``buildkit estimate`` walks the graph with it (``engine/estimate.py``)."""

    def estimate(self, params: Params, inputs: dict[str, list[dict]]) -> dict[str, dict]:
        """Output name -> layout, from the input slots' layouts (those estimated)."""


@runtime_checkable
class SharesResource(Protocol):
    """A step that runs one at a time with the others naming the same ``resource``, whatever
    ``-j`` says: "forward" for those running a model's forward pass (calibrate, reference,
    eval, sensitivity), each of which fills every core and holds a layer and the hidden
    states; two at once took twice the memory and no less time."""

    resource: str


def resource(step: Step) -> str | None:
    """The resource a step shares (``SharesResource``), or None."""
    return step.resource if isinstance(step, SharesResource) else None


@runtime_checkable
class Publishes(Protocol):
    """A step that writes a directory outside the store (what ``build --push`` uploads)."""

    def destination(self, params: Params, ctx: Context) -> Path:
        """The directory it writes."""


REGISTRY: dict[str, type[Step]] = {}
_plugins: list = []  # the entry points loaded, once


def register(cls: type[Step]) -> type[Step]:
    """Add a step kind to the registry (a class decorator)."""
    if cls.kind in REGISTRY:
        raise RuntimeError(f"step kind {cls.kind!r} registered twice")
    if issubclass(cls, WorldStep) and cls.watch is WorldStep.watch:
        # uptodate would trust stats that say nothing of what the step looked at
        raise RuntimeError(
            f"step kind {cls.kind!r} is a WorldStep: override watch, naming the files its "
            "fingerprint and outdated look at (or returning None if a stat cannot tell)"
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

    def grow(self, n: int) -> None:
        """``n`` more to do than ``start`` said (a pass found, once started, to need parts)."""
        with self.lock:
            self.total += n
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
    fingerprint: Any = None  # what ``fingerprint(step, ...)`` gave for this run's key
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
