"""Per-tensor work on a Dask cluster (``build --dask ADDRESS``), imported only then.

A step hands ``Context.map`` a top-level function ``fn(store, *args)`` and (name, args)
tasks; here each becomes a Dask task keyed by ``fn``'s name, the node's action key, the
tensor and the store, so two clients building overlapping variants on one cluster share
the tasks while they are in the scheduler. A worker opens the store from its root string
and reads and writes tensors there by path; futures carry the small entry dicts (digests),
never tensors. The client assembles the artifact and records the action as a local build
does, so the bytes are the same.

With ``--remote URL`` the workers share no path with the client (``store/detached.py``): a
task carries the remote's URL and, for each source file it reads, the file's URL, size and
sha256 (``hub.range_ref``); the client first uploads the input objects the remote lacks, a
worker reads objects from the remote and source tensors by byte range into a store of its own
(``BUILDKIT_STORE``, else ``buildkit-worker/`` in its working directory) and uploads what it
makes; the client copies the outputs into its packs, each checked against its digest. Tasks
that read one source tensor prefer one worker (chosen by the tensor's name), so its bytes
cross the network once. Without ``--remote``, every worker must see the store (and the source
files it indexes) at the same path: one machine (``local:N``), or a disk all machines mount
at that path.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from importlib.metadata import version
from pathlib import Path

from buildkit.core import allocator, keys, workers
from buildkit.core.errors import StepError, UsageError
from buildkit.store import packs

_stores: dict[str, object] = {}


def _store(where: str | dict):
    """The store a task runs on: the client's at its root (a shared disk), or this worker's own
    (``detached.py``) for a build with a remote."""
    from buildkit.store.store import Store

    if isinstance(where, str):
        s = _stores.get(where)
        if s is None:
            s = _stores[where] = Store(where)
        return s
    from buildkit.store.detached import DetachedStore, worker_name

    root = os.environ.get("BUILDKIT_STORE") or str(Path.cwd() / "buildkit-worker")
    s = _stores.get(where["remote"])
    if s is None:  # one per remote: the headers it has read stay parsed
        s = _stores[where["remote"]] = DetachedStore(root, where["remote"], {}, worker_name())
    s.sources_ref.update(where["sources"])
    return s


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run_task(where: str | dict, libraries: dict[str, str], fn: Callable, *args):
    """On a worker: ``fn(store, *args)`` with the store at ``where`` (a root), or this worker's
    own for a remote (``{"remote", "sources"}``: then the result and the pack slots it filled,
    every object uploaded). The objects a result names are made durable before their digests
    go back (a listing must never name an object a crash loses): an fsync each, as one syncfs
    per task waits for everything else the machine writes (bench/RESULTS.md, "Tried and not
    kept")."""
    have = {name: version(name) for name in libraries}
    if have != libraries:
        raise StepError(
            f"worker {os.uname().nodename} has {have}, the build needs {libraries}; "
            f"install buildkit with -c constraints.txt on every worker"
        )
    if not _stores:  # a worker's first task: malloc as a local build has it
        allocator.tune(force=True)
    store = _store(where)
    packs.SYNC_WRITES = True  # a worker's pack writes are durable before its task returns
    # On buildkit's long-lived threads, not Dask's: mlx aborts a process whose mlx thread exits.
    if not isinstance(where, str):
        out, placed = workers.pool("dask-task").submit(_placed, fn, store, args, workers=1).result()
        allocator.tune_imported()
        store.upload_outputs(out, placed)
        return out, placed
    out = workers.pool("dask-task").submit(fn, store, *args, workers=1).result()
    allocator.tune_imported()
    if isinstance(out, dict):
        paths = {
            store.object_path(e["digest"])
            for e in out.values()
            if isinstance(e, dict) and "digest" in e and "pack" not in e
        }
        for path in sorted(paths):
            _fsync(path)
        for d in sorted({p.parent for p in paths}):
            _fsync(d)
    return out


def _placed(fn: Callable, store, args: tuple) -> tuple:
    """``fn(store, *args)`` and the pack slots it filled, on the one thread that runs tasks."""
    store.placed = []
    return fn(store, *args), store.placed


class DaskExecutor:
    """A Dask client for one build, connected (and for ``local:N`` a cluster started) at the
    first task: a build whose steps are all cached starts nothing."""

    def __init__(self, address: str, remote=None, store=None):
        self.address, self.workers = address, 0
        self.remote, self.store = remote, store  # a remote: workers without the client's disk
        if address.startswith("local:"):
            n = address.removeprefix("local:")
            if not n.isdigit() or int(n) < 1:
                raise UsageError(f"--dask {address!r}: local:N needs a worker count N >= 1")
            self.workers = int(n)
        elif not address.startswith(("tcp://", "tls://")):
            raise UsageError(
                f"--dask {address!r}: give a scheduler address (tcp://host:8786) or local:N"
            )
        self.client = self.cluster = None
        self.lock = threading.Lock()

    def _connect(self):
        with self.lock:
            if self.client is not None:
                return self.client
            try:
                from distributed import Client, LocalCluster
            except ImportError:
                raise UsageError(
                    "--dask needs dask.distributed: pip install distributed -c constraints.txt"
                ) from None
            address = self.address
            if self.workers:  # one thread per worker process: a task is one tensor's mlx work
                self.cluster = LocalCluster(
                    n_workers=self.workers,
                    threads_per_worker=1,
                    processes=True,
                    host="127.0.0.1",
                    dashboard_address=None,
                )
                address = self.cluster.scheduler_address
            try:
                self.client = Client(address, timeout="30s")
            except OSError as e:
                raise StepError(
                    f"--dask: cannot reach the Dask scheduler at {address}: {e}"
                ) from None
            return self.client

    def map(
        self,
        fn: Callable,
        tasks: Iterable[tuple[str, tuple]],
        root: str,
        action_key: str,
        libraries: dict[str, str],
    ) -> Iterator:
        """``fn(store, *args)`` for each (name, args), submitted now; the results, in task order."""
        client = self._connect()
        if self.remote is not None:
            return self._detached(client, fn, list(tasks), action_key, libraries)
        where = keys.short(keys.digest_json("dask-store", root), 8)
        futures = [
            client.submit(
                run_task,
                root,
                libraries,
                fn,
                *args,
                pure=False,
                key=f"{fn.__name__}-{keys.short(action_key)}-{name}-{where}",
            )
            for name, args in tasks
        ]
        return self._results(client, futures)

    def _detached(self, client, fn, tasks: list, action_key: str, libraries: dict) -> Iterator:
        """Tasks for workers without the client's disk: their input objects into the remote
        first, each task told where its source files are and steered to the worker of the
        first source tensor it reads."""
        from buildkit.store.detached import task_inputs
        from buildkit.store.hub import range_ref

        objs, packed, refs, firsts = {}, {}, {}, []
        for _, args in tasks:
            o, p, srcs = task_inputs(args)
            objs.update(o)
            packed.update(p)
            for d, _t in srcs:
                if d not in refs:
                    refs[d] = range_ref(self.store.sources.resolve(d))
            firsts.append(min(srcs, default=None))
        try:  # a packed tensor a worker uploaded alone is read so; else from its pack
            missing = self.remote.missing(list(packed))
            objs.update({packed[t][0]: None for t in missing})
            self.remote.ensure_objects(self.store, objs)
        except StepError:
            raise
        except Exception as e:
            raise StepError(
                f"--dask with --remote: cannot upload the tasks' inputs to {self.remote.url}: "
                f"{type(e).__name__}: {e}"
            ) from e
        names = sorted(client.scheduler_info(n_workers=-1)["workers"])
        tag = keys.short(
            keys.digest_json("dask-remote", [self.remote.url, str(self.store.root)]), 8
        )
        futures = []
        for (name, args), first in zip(tasks, firsts):
            where = {"remote": self.remote.url, "sources": refs}
            prefer = None
            if first and names:  # stable: quantize and verify of one tensor on one worker
                prefer = [names[int(keys.digest_json("worker", list(first))[-8:], 16) % len(names)]]
            futures.append(
                client.submit(
                    run_task,
                    where,
                    libraries,
                    fn,
                    *args,
                    pure=False,
                    workers=prefer,
                    allow_other_workers=bool(prefer),
                    key=f"{fn.__name__}-{keys.short(action_key)}-{name}-{tag}",
                )
            )
        return self._placed(self._results(client, futures))

    def _placed(self, results: Iterator) -> Iterator:
        """Each detached result, once the objects it put in pack slots are in the client's."""
        with contextlib.closing(results):
            for out, placed in results:
                for p in placed:
                    self.remote.get_into(p["digest"], p["dtype"], p["shape"], *p["slot"])
                yield out

    @staticmethod
    def _results(client, futures) -> Iterator:
        try:
            for f in futures:
                yield f.result()
        finally:  # only this client's interest: a task another client waits for runs on
            client.cancel(futures)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.cluster is not None:
            self.cluster.close()
