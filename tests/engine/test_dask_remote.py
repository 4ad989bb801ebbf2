"""build --dask ADDRESS --remote URL on a cluster whose workers share no disk with the client.

A real ``dask scheduler`` and two ``dask worker`` processes on loopback, each with its own
working directory and ``BUILDKIT_STORE``. Each worker runs in a mount namespace of its own
(``unshare --mount``, as root) with an empty tmpfs over the client's project (store, outputs,
manifests, HF cache) and the source's directory, so it cannot read them; the test checks that
from inside the workers. The source is ``hf://`` on the loopback Hub (tests/hubserver.py), the
remote an S3 bucket on moto's server on loopback. Every process started here is stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import distributed
import pytest
from conftest import REPO, Project, ran
from hubserver import Hub
from s3server import CREDS, free_port, moto_s3, s3_client

from buildkit.fixtures.generated import FixtureSpec, generate
from buildkit.formats.tensors import read_header

pytestmark = pytest.mark.skipif(
    shutil.which("unshare") is None or os.geteuid() != 0,
    reason="workers are isolated with unshare --mount, which needs root",
)

DASK = str(Path(sys.executable).with_name("dask"))
# the worker's command, run with the hidden directories' paths in $HIDE
ISOLATE = 'set -e; for d in $HIDE; do mount -t tmpfs -o size=1m tmpfs "$d"; done; exec "$0" "$@"'


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    src = generate(tmp_path_factory.mktemp("dask-src") / "tiny", FixtureSpec())
    with Hub() as h:
        h.source_dir = src
        h.sha = h.upload_dir("org/tiny", src)
        yield h


class Cluster:
    """A scheduler and workers started as processes; ``stop`` ends every one of them."""

    def __init__(self, root: Path, env: dict[str, str]):
        self.root, self.env, self.procs = root, env, []
        self.workers: dict[str, subprocess.Popen] = {}
        sched = root / "scheduler.json"
        self.procs.append(self._start(
            [DASK, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
             "--scheduler-file", str(sched)],
            {**env, "DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING": "False"}, root,
        ))  # fmt: skip
        self.address = self._wait(lambda: json.loads(sched.read_text())["address"], "scheduler")

    def _start(self, argv, env, cwd) -> subprocess.Popen:
        log = open(cwd / f"{Path(argv[0]).name}-{len(self.procs)}.log", "w")
        return subprocess.Popen(
            argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    @staticmethod
    def _wait(get, what: str, timeout: float = 30):
        t = time.monotonic()
        while time.monotonic() - t < timeout:
            with contextlib.suppress(Exception):
                return get()
            time.sleep(0.2)
        raise AssertionError(f"{what} did not start in {timeout}s")

    def add_worker(self, name: str, hide: list[Path], env: dict[str, str] | None = None) -> Path:
        """A worker in its own mount namespace, the ``hide`` directories covered by tmpfs."""
        home = self.root / name
        home.mkdir(exist_ok=True)
        wenv = {**self.env, **(env or {}), "BUILDKIT_STORE": str(home / "store")}
        wenv.update(HIDE=" ".join(map(str, hide)), HF_HOME=str(home / "hf"))
        proc = self._start(
            ["unshare", "--mount", "sh", "-c", ISOLATE, DASK, "worker", self.address,
             "--name", name, "--nthreads", "1", "--no-nanny", "--no-dashboard",
             "--local-directory", str(home / "dask")],
            wenv, home,
        )  # fmt: skip
        self.procs.append(proc)
        self.workers[name] = proc
        return home

    def client(self):
        return distributed.Client(self.address, timeout="30s")

    def wait_for(self, n: int) -> None:
        with self.client() as c:
            c.wait_for_workers(n, timeout=60)

    def stop(self) -> None:
        for p in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


def client_env(hub: Hub, s3: str, home: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_TOKEN", "HF_HUB_CACHE", "AWS_PROFILE", "BUILDKIT_REMOTE")
        and not k.startswith("BUILDKIT_")
    }
    env.update(hub.env(home), **CREDS, AWS_ENDPOINT_URL=s3, PYTHONPATH=str(REPO))
    return env


@pytest.fixture
def setup(tmp_path, hub, s3):
    """A client project, a fresh bucket and a cluster of two isolated workers."""
    project = Project(tmp_path / "client")
    project.root.mkdir(exist_ok=True)
    env = client_env(hub, s3, project.root / "hf")
    bucket = "b" + uuid.uuid4().hex[:12]
    _bucket(s3, bucket)
    (tmp_path / "cluster").mkdir()
    cluster = Cluster(tmp_path / "cluster", env)
    hide = [project.root, hub.source_dir]
    try:
        for name in ("w0", "w1"):
            cluster.add_worker(name, hide)
        cluster.wait_for(2)
        yield project, env, f"s3://{bucket}/cache", cluster, hide
    finally:
        cluster.stop()


def _bucket(endpoint: str, name: str) -> None:
    s3_client(endpoint).create_bucket(Bucket=name)


def outputs(project: Project, variant: str) -> dict:
    ref = json.loads((project.store / "refs" / f"{variant}.json").read_text())
    return {n: (v["key"], v["outputs"]) for n, v in sorted(ref["nodes"].items())}


def published(out: Path) -> dict[str, bytes]:
    return {
        p.relative_to(out).as_posix(): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


@pytest.fixture(scope="module")
def local(hub, s3, tmp_path_factory) -> Project:
    """The same variant built in one process from the same hf:// source: the bytes to match."""
    p = Project(tmp_path_factory.mktemp("dask-local"))
    env = client_env(hub, s3, p.root / "hf")
    src = f"hf://org/tiny@{hub.sha}"
    p.run("build", "xl-mtp", "--source", src, "--out", str(p.out / "xl-mtp"), env=env)
    return p


def build(project: Project, env, cluster: Cluster, remote: str, hub: Hub, check=True):
    return project.run(
        "build", "xl-mtp", "--source", f"hf://org/tiny@{hub.sha}",
        "--out", str(project.out / "xl-mtp"), "--dask", cluster.address, "--remote", remote,
        env=env, check=check, timeout=300,
    )  # fmt: skip


def ranged_reads(hub: Hub) -> dict[str, list[tuple[int, int]]]:
    """[start, end) of every ranged GET of a shard, by file: the workers' reads (the client's
    snapshot download asks for whole files)."""
    out: dict[str, list[tuple[int, int]]] = {}
    for method, path, rng in hub.requests:
        if method == "GET" and rng and path.endswith(".safetensors"):
            a, b = re.fullmatch(r"bytes=(\d+)-(\d+)", rng).groups()
            out.setdefault(path.rsplit("/", 1)[1], []).append((int(a), int(b) + 1))
    return out


def test_workers_without_the_clients_disk_build_a_local_builds_bytes(setup, hub, local):
    project, env, remote, cluster, hide = setup
    with cluster.client() as c:  # the workers cannot see the client's files
        seen = c.run(lambda dirs: [os.listdir(d) for d in dirs], [str(d) for d in hide])
    assert seen and all(v == [[], []] for v in seen.values()), seen
    hub.requests.clear()
    p = build(project, env, cluster, remote, hub)
    assert {"quantize", "requantize", "verify", "verify_head"} <= set(ran(p)), p.stderr
    assert outputs(project, "xl-mtp") == outputs(local, "xl-mtp")
    assert published(project.out / "xl-mtp") == published(local.out / "xl-mtp")

    # each source tensor's bytes crossed the network once in all, one tensor per range
    reads = ranged_reads(hub)
    assert reads, "the workers read nothing from the Hub"
    for name, spans in reads.items():
        tensors = {(t.start, t.end) for t in read_header(hub.source_dir / name).tensors.values()}
        n = int.from_bytes((hub.source_dir / name).read_bytes()[:8], "little")
        data = sorted(s for s in spans if s not in ((0, 8), (8, 8 + n)))
        assert set(data) <= tensors, f"{name}: a read that is not one tensor: {set(data) - tensors}"
        assert len(data) == len(set(data)), f"{name}: a tensor was read twice: {sorted(spans)}"
        assert len(spans) - len(data) <= 2 * len(cluster.workers)  # its header once per worker


def cluster_build(project: Project, env, cluster: Cluster, remote: str, hub: Hub):
    """The build started in the background (its stdout and stderr read when it ends)."""
    return subprocess.Popen(
        [sys.executable, "-m", "buildkit.cli", *project.args(
            "build", "xl-mtp", "--source", f"hf://org/tiny@{hub.sha}",
            "--out", str(project.out / "xl-mtp"), "--dask", cluster.address, "--remote", remote,
        )],
        cwd=project.root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_worker_killed_mid_task_the_task_reruns_on_the_other(setup, hub, local):
    project, env, remote, cluster, _ = setup
    proc = cluster_build(project, env, cluster, remote, hub)
    killed = None
    try:
        with cluster.client() as c:
            t = time.monotonic()
            while killed is None and proc.poll() is None and time.monotonic() - t < 120:
                busy = {a: ks for a, ks in c.processing().items() if ks}
                names = {a: w["name"] for a, w in c.scheduler_info()["workers"].items()}
                for addr, ks in busy.items():
                    if any(str(k).startswith("pack_entry-") for k in ks):
                        killed = (names[addr], [str(k) for k in ks])
                        os.killpg(cluster.workers[names[addr]].pid, signal.SIGKILL)
                        break
                time.sleep(0.05)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert killed, "no worker was running a quantize task"
    assert proc.returncode == 0, err
    assert cluster.workers[killed[0]].poll() is not None  # it stayed dead: the other ran them
    assert outputs(project, "xl-mtp") == outputs(local, "xl-mtp")
    assert published(project.out / "xl-mtp") == published(local.out / "xl-mtp")


def test_corrupt_object_in_the_remote_is_refused_by_its_reader_and_rebuilt(setup, hub, local):
    """An object the client would upload is already in the bucket, with wrong bytes: the
    client skips it (the bucket has it), the worker that reads it refuses it, named, and
    removes it; the build runs the node again, the client uploads its own copy."""
    project, env, remote, cluster, _ = setup
    from buildkit.store.artifact import objects
    from buildkit.store.store import Store

    store = Store(local.store)
    art = store.get_artifact(outputs(local, "xl-mtp")["sanitize"][1]["model"])
    digest = next(d for d, shape in sorted(objects(art).items()) if shape)
    bad = bytearray(store.object_path(digest).read_bytes())
    bad[0] ^= 0xFF
    bucket, prefix = remote.removeprefix("s3://").split("/", 1)
    key = f"{prefix}/objects/{digest.split(':')[1][:2]}/{digest.split(':')[1][2:]}"
    s3_client(env["AWS_ENDPOINT_URL"]).put_object(Bucket=bucket, Key=key, Body=bytes(bad))
    p = build(project, env, cluster, remote, hub)
    refused = [line for line in p.stderr.splitlines() if "is corrupt" in line]
    assert refused and re.search(r"worker w[01] on ", refused[0]), p.stderr
    assert f"{remote}/{key.split('/', 1)[1]}" in refused[0]
    assert "building again" in p.stderr
    assert outputs(project, "xl-mtp") == outputs(local, "xl-mtp")
    assert published(project.out / "xl-mtp") == published(local.out / "xl-mtp")
    got = s3_client(env["AWS_ENDPOINT_URL"]).get_object(Bucket=bucket, Key=key)["Body"].read()
    assert got == store.object_path(digest).read_bytes()  # the good copy is there now


def test_remote_unreachable_from_a_worker_fails_the_build_cleanly(tmp_path, hub, s3):
    """Workers whose S3 endpoint is a closed port: the first task fails, naming its worker
    and the remote; the build stops (exit 1) and records nothing for the failed steps."""
    project = Project(tmp_path / "client")
    env = client_env(hub, s3, project.root / "hf")
    bucket = "b" + uuid.uuid4().hex[:12]
    _bucket(s3, bucket)
    (tmp_path / "cluster").mkdir()
    cluster = Cluster(tmp_path / "cluster", env)
    try:
        cluster.add_worker(
            "w0", [project.root], {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}
        )
        cluster.wait_for(1)
        p = build(project, env, cluster, f"s3://{bucket}/cache", hub, check=False)
    finally:
        cluster.stop()
    assert p.returncode == 1, p.stderr
    err = p.stderr.splitlines()[-1]
    assert re.search(rf"worker w0 on .*the remote s3://{bucket}/cache failed", err), p.stderr
    assert "check that this worker reaches it" in err
    assert not (project.store / "refs" / "xl-mtp.json").exists()
    done = {
        json.loads(f.read_text())["node"]
        for f in (project.store / "actions").rglob("*")
        if f.is_file()
    }
    # whole steps only: those that run in the client (no per-tensor tasks on a worker)
    assert done <= {"fetch", "sanitize", "graft", "reference"}, done
    assert not list((project.store / "tmp").glob("pack-*"))


def test_worker_with_other_library_versions_is_refused(tmp_path, hub, s3):
    """A worker whose mlx metadata says another version refuses its tasks, as today."""
    project = Project(tmp_path / "client")
    env = client_env(hub, s3, project.root / "hf")
    bucket = "b" + uuid.uuid4().hex[:12]
    _bucket(s3, bucket)
    fake = tmp_path / "fake"
    (fake / "mlx-0.0.1.dist-info").mkdir(parents=True)
    (fake / "mlx-0.0.1.dist-info" / "METADATA").write_text("Name: mlx\nVersion: 0.0.1\n")
    (tmp_path / "cluster").mkdir()
    cluster = Cluster(tmp_path / "cluster", env)
    try:
        cluster.add_worker("w0", [project.root], {"PYTHONPATH": f"{fake}:{REPO}"})
        cluster.wait_for(1)
        p = build(project, env, cluster, f"s3://{bucket}/cache", hub, check=False)
    finally:
        cluster.stop()
    assert p.returncode == 1, p.stderr
    assert "'mlx': '0.0.1'" in p.stderr and "the build needs" in p.stderr, p.stderr
    assert "install buildkit with -c constraints.txt on every worker" in p.stderr
