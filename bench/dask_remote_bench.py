"""``dask_bench.py --no-shared-disk``: a local build, ``--dask local:2`` on a shared disk, and
two Dask workers with their own disks and ``--remote``, from one ``hf://`` source on the
loopback Hub; wall time and the bytes each moved (see dask_bench.py's docstring)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
MB = 1e6
CREDS = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class CountingProxy:
    """A TCP proxy in front of the S3 server: bytes sent up (requests) and down (responses)."""

    def __init__(self, port: int):
        self.up_port, self.up, self.down = port, 0, 0
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.lsock.getsockname()[1]}"
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            u = socket.create_connection(("127.0.0.1", self.up_port))
            threading.Thread(target=self._pump, args=(c, u, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c, "down"), daemon=True).start()

    def _pump(self, src, dst, way: str) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                with self.lock:
                    setattr(self, way, getattr(self, way) + len(data))
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def reset(self) -> None:
        with self.lock:
            self.up = self.down = 0


def start_cluster(work: Path, env: dict) -> tuple[str, list[subprocess.Popen]]:
    """A scheduler and two single-threaded workers, each with its own directory and store."""
    dask = str(Path(sys.executable).with_name("dask"))
    sched = work / "scheduler.json"
    sched.unlink(missing_ok=True)
    procs = [
        subprocess.Popen(
            [dask, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
             "--scheduler-file", str(sched)],
            env={**env, "DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING": "False"},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
    ]  # fmt: skip
    for _ in range(300):
        with contextlib.suppress(Exception):
            address = json.loads(sched.read_text())["address"]
            break
        time.sleep(0.1)
    for i in range(2):
        home = work / f"worker{i}"
        home.mkdir(exist_ok=True)
        procs.append(
            subprocess.Popen(
                [dask, "worker", address, "--name", f"w{i}", "--nthreads", "1", "--no-nanny",
                 "--no-dashboard", "--local-directory", str(home / "dask")],
                env={**env, "BUILDKIT_STORE": str(home / "store"), "HF_HOME": str(home / "hf")},
                cwd=home, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )  # fmt: skip
    from distributed import Client

    with Client(address, timeout="60s") as c:
        c.wait_for_workers(2, timeout=120)
    return address, procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        p.wait(30)


def no_shared_disk(work: Path, src: Path, env: dict, build) -> tuple[str, bool]:
    """The three runs and their table (markdown); whether their outputs are identical."""
    import logging
    import shutil

    import boto3
    from hubserver import Hub
    from moto.server import ThreadedMotoServer

    from buildkit.formats.tensors import read_header

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    proxy = CountingProxy(port)
    for d in ("worker0", "worker1", "hf"):
        shutil.rmtree(work / d, ignore_errors=True)
    try:
        with Hub() as hub:
            sha = hub.upload_dir("bench/fixture", src)
            env = {**env, **hub.env(work / "hf"), **CREDS, "AWS_ENDPOINT_URL": proxy.url}
            source = f"hf://bench/fixture@{sha}"
            subprocess.run(  # the client's HF cache, filled once and not timed
                [sys.executable, "-c", f"from huggingface_hub import snapshot_download as s; "
                 f"s('bench/fixture', revision='{sha}')"], env=env, check=True,
            )  # fmt: skip
            boto3.client("s3", endpoint_url=proxy.url, **_lower(CREDS)).create_bucket(
                Bucket="bench"
            )
            runs = {}
            hub.served.clear()
            runs["local"] = build(work, "hf-local", source, env)
            runs["local:2"] = build(work, "hf-local2", source, env, "--dask", "local:2")
            address, procs = start_cluster(work, env)
            try:
                hub.served.clear()
                proxy.reset()
                runs["remote"] = build(
                    work, "hf-remote", source, env, "--dask", address, "--remote", "s3://bench/c"
                )
            finally:
                stop(procs)
            hub_bytes, up, down = sum(hub.served.values()), proxy.up, proxy.down
    finally:
        moto.stop()
    tensors = sum(
        sum(t.nbytes for t in read_header(f).tensors.values()) for f in src.glob("*.safetensors")
    )
    out = work / "out-hf-local"
    published = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    same = runs["local"]["outputs"] == runs["local:2"]["outputs"] == runs["remote"]["outputs"]
    moved = hub_bytes + up + down
    ideal = tensors + published
    lines = [
        f"Run of {time.strftime('%Y-%m-%d %H:%M UTC')}, {os.cpu_count()} cores; fixture "
        f"{tensors / MB:.0f} MB of bf16 tensors served by the loopback Hub; `xl`, cold stores, "
        f"the client's HF cache filled first. Outputs identical: {'yes' if same else '**NO**'}.",
        "",
        "| run | wall | CPU (client) | quantize step |",
        "|---|---|---|---|",
        *(
            f"| {label} | {r['wall']:.1f} s | {r['cpu']:.1f} s | "
            f"{r['steps'].get('quantize', 0.0):.1f} s |"
            for label, r in (
                ("local (2 threads)", runs["local"]),
                ("`--dask local:2`, shared disk", runs["local:2"]),
                ("two workers, own disks, `--remote` (cluster up)", runs["remote"]),
            )
        ),
        "",
        f"Bytes moved by the no-shared-disk build: Hub ranged reads {hub_bytes / MB:.0f} MB, "
        f"remote up {up / MB:.0f} MB, down {down / MB:.0f} MB (HTTP included): "
        f"{moved / MB:.0f} MB, {moved / ideal:.2f}x of source tensors once + published "
        f"({tensors / MB:.0f} + {published / MB:.0f} MB; target 1.1x).",
    ]
    return "\n".join(lines), same


def _lower(d: dict) -> dict:
    return {
        "aws_access_key_id": d["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": d["AWS_SECRET_ACCESS_KEY"],
        "region_name": d["AWS_DEFAULT_REGION"],
    }
