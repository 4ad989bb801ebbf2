"""Per-tensor work on a Dask cluster (``build --dask ADDRESS``), imported only then.

A step hands ``Context.map`` a top-level function ``fn(store, *args)`` and (name, args)
tasks; here each becomes a Dask task keyed by ``fn``'s name, the node's action key, the
tensor and the store, so two clients building overlapping variants on one cluster share
the tasks while they are in the scheduler. A worker opens the store from its root string
and reads and writes tensors there by path; futures carry the small entry dicts (digests),
never tensors. The client assembles the artifact and records the action as a local build
does, so the bytes are the same.

Every worker must see the store (and the source files it indexes) at the same path: one
machine (``local:N``), or a disk all machines mount at that path.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from importlib.metadata import version
from pathlib import Path

from buildkit.core import allocator, keys, workers
from buildkit.core.errors import StepError, UsageError
from buildkit.store import packs

_stores: dict[str, object] = {}


def _store(root: str):
    from buildkit.store.store import Store

    s = _stores.get(root)
    if s is None:
        s = _stores[root] = Store(root)
    return s


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run_task(root: str, libraries: dict[str, str], fn: Callable, *args):
    """On a worker: ``fn(store, *args)`` with the store at ``root``. The objects its result
    names are made durable before their digests go back (a listing must never name an object
    a crash loses): an fsync each, as one syncfs per task waits for everything else the
    machine writes (bench/RESULTS.md)."""
    have = {name: version(name) for name in libraries}
    if have != libraries:
        raise StepError(
            f"worker {os.uname().nodename} has {have}, the build needs {libraries}; "
            f"install buildkit with -c constraints.txt on every worker"
        )
    if root not in _stores:  # a worker's first task: malloc as a local build has it
        allocator.tune(force=True)
    store = _store(root)
    packs.SYNC_WRITES = True  # a worker's pack writes are durable before its task returns
    # On buildkit's long-lived threads, not Dask's: mlx aborts a process whose mlx thread exits.
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


class DaskExecutor:
    """A Dask client for one build, connected (and for ``local:N`` a cluster started) at the
    first task: a build whose steps are all cached starts nothing."""

    def __init__(self, address: str):
        self.address, self.workers = address, 0
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
