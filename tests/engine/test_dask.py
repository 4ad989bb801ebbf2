"""build --dask: per-tensor work on a real Dask cluster gives a local build's bytes.

A LocalCluster of two worker processes (one thread each, loopback only) is started here; a
scheduler plugin counts each task's runs (processing -> memory) and can kill a worker.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading

import distributed
import pytest
from distributed.diagnostics.plugin import SchedulerPlugin

from buildkit.engine.distributed import DaskExecutor
from buildkit.quant.quantize import quantize_entry
from buildkit.quant.roles import Role
from buildkit.store.store import Store


class Tasks(SchedulerPlugin):
    """Runs per task key, seen by the scheduler; optionally kills the worker of a running
    quantize task once the first quantize task has finished."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.runs: collections.Counter = collections.Counter()
        self.ran_on: dict[str, int] = {}  # key -> pid of the worker that finished it
        self.kill = False
        self.killed: list[tuple[int, list[str]]] = []  # (pid, keys it was running)

    def transition(self, key, start, finish, *args, **kwargs):
        if start != "processing" or finish != "memory":
            return
        self.runs[key] += 1
        self.ran_on[str(key)] = next(iter(self.scheduler.tasks[key].who_has)).pid
        if self.kill and not self.killed and str(key).startswith("pack_entry-"):
            busy = [ws for ws in self.scheduler.workers.values() if ws.processing]
            if busy:
                ws = busy[0]
                self.killed.append((ws.pid, [str(ts.key) for ts in ws.processing]))
                os.kill(ws.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster():
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None
    ) as c:
        plugin = Tasks(c.scheduler)
        c.scheduler.add_plugin(plugin, name="buildkit-test-tasks")
        yield c, plugin


def outputs(project, variant: str) -> dict:
    """Every node's key and output digests, as the variant's ref records them."""
    ref = json.loads((project.store / "refs" / f"{variant}.json").read_text())
    return {n: (v["key"], v["outputs"]) for n, v in sorted(ref["nodes"].items())}


def published(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def assert_same_as_local(project, seed, variant: str) -> None:
    assert outputs(project, variant) == outputs(seed, variant)
    assert published(project.out / variant) == published(seed.out / variant)


def test_local_cluster_build_is_byte_identical(project, seed):
    p = project.build("xl-mtp", "--dask", "local:2")
    assert {"quantize", "requantize"} <= set(n for n in outputs(project, "xl-mtp"))
    assert "[run]    quantize" in p.stderr
    assert_same_as_local(project, seed, "xl-mtp")


def test_worker_killed_mid_quantize_is_retried(project, seed, cluster):
    c, tasks = cluster
    c.wait_for_workers(2)
    tasks.runs.clear()
    tasks.kill, tasks.killed = True, []
    try:
        project.build("xl", "--dask", c.scheduler_address)
    finally:
        tasks.kill = False
    assert tasks.killed, "no worker was running a quantize task when the first one finished"
    pid, running = tasks.killed[0]
    assert running and all(tasks.ran_on[k] != pid for k in running)  # ran again elsewhere
    assert_same_as_local(project, seed, "xl")


def test_two_clients_share_tasks(project, seed, cluster):
    """xl and xl-mtp at once on one cluster and store: xl's quantize tasks run once."""
    c, tasks = cluster
    c.wait_for_workers(2)
    tasks.runs.clear()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "buildkit.cli",
                *project.args(
                    "build", v, "--out", str(project.out / v), "--dask", c.scheduler_address
                ),
            ],
            cwd=project.root,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for v in ("xl", "xl-mtp")
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
    kinds = collections.Counter(str(k).split("-")[0] for k in tasks.runs)
    assert kinds["pack_entry"] and kinds["inspect_tensor"], kinds  # quantize and verify
    assert max(tasks.runs.values()) == 1, tasks.runs.most_common(3)
    for v in ("xl", "xl-mtp"):
        assert_same_as_local(project, seed, v)


def test_same_key_from_two_clients_runs_once(project, seed, cluster):
    """Dask's side of sharing, without the store's key lock: two executors (two clients)
    submit the same tensors of the same action at once; each task runs once."""
    c, tasks = cluster
    c.wait_for_workers(2)
    tasks.runs.clear()
    store = Store(project.adopt(seed).store)
    art = store.get_artifact(outputs(seed, "xl")["sanitize"][1]["model"])
    names = sorted(
        n
        for n, e in art.tensors.items()
        if n.endswith(".weight") and len(e["shape"]) >= 2 and e["shape"][-1] % 64 == 0
    )[:6]
    role = Role(bits=4, group_size=64)
    todo = [(n, (n, art.tensors[n], role)) for n in names]
    execs = [DaskExecutor(c.scheduler_address) for _ in range(2)]
    try:
        its = [
            ex.map(quantize_entry, todo, str(store.root), "xxh3_128:" + "ab" * 16, {})
            for ex in execs
        ]
        got: list = [None, None]

        def gather(i):
            got[i] = list(its[i])

        threads = [threading.Thread(target=gather, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        for ex in execs:
            ex.close()
    assert got[0] == got[1] and len(got[0]) == len(names)
    assert sorted(tasks.runs) == sorted(
        k for k in tasks.runs if str(k).startswith("quantize_entry-abababababab-")
    )
    assert len(tasks.runs) == len(names) and set(tasks.runs.values()) == {1}
    local = [quantize_entry(store, *args) for _, args in todo]
    assert got[0] == local


def test_bad_address_is_refused_before_any_step(project):
    p = project.run("build", "xl", "--dask", "localhost:8786", check=False)
    assert p.returncode == 2
    assert (
        "--dask 'localhost:8786': give a scheduler address (tcp://host:8786) or local:N" in p.stderr
    )
    assert "[run]" not in p.stderr
