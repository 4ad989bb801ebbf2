"""Throughput of ``buildkit push`` / ``buildkit pull`` against the server's raw speed.

Not in CI. On a fixture of a few hundred MB: build xl locally, then push its closure to an
S3 server (moto's, in a process of its own on 127.0.0.1) and pull it into an empty store,
and move the very same object files with plain boto3 (the same threads and transfer
settings, no hashing) for the raw figure. The same for a file:// remote against copying
the objects directory. Prints a table; the figures go in the report, not in RESULTS.md.

    python bench/remote.py [--dir /tmp/buildkit-bench-remote] [--layers 8]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(
    0, str(REPO)
)  # this checkout's buildkit, as the subprocesses get through PYTHONPATH
BUILDKIT = [sys.executable, "-m", "buildkit.cli"]
CREDS = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
}
MB = 1e6


def run(argv: list[str], cwd: Path, env: dict) -> tuple[float, str]:
    t = time.monotonic()
    p = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    dt = time.monotonic() - t
    if p.returncode:
        sys.exit(f"{' '.join(argv)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return dt, p.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(100):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"http://127.0.0.1:{port}"
        time.sleep(0.1)
    proc.kill()
    sys.exit("moto server did not start")


def objects(store: Path) -> list[Path]:
    return sorted(p for p in (store / "objects").rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dir", default="/tmp/buildkit-bench-remote")
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), **CREDS}
    for k in ("BUILDKIT_REMOTE", "BUILDKIT_SIGNING_KEY", "BUILDKIT_TRUSTED_KEYS"):
        env.pop(k, None)

    src = root / "src"
    run(
        [
            *BUILDKIT,
            "fixture",
            str(src),
            "--hidden",
            "1024",
            "--layers",
            str(args.layers),
            "--experts",
            "16",
            "--moe-intermediate",
            "512",
            "--vocab",
            "16384",
        ],
        root,
        env,
    )
    src_mb = sum(p.stat().st_size for p in src.rglob("*") if p.is_file()) / MB

    def project(name: str) -> Path:
        d = root / name
        shutil.copytree(
            REPO / "manifests", d / "manifests", ignore=shutil.ignore_patterns("*.lock")
        )
        return d

    def bk(d: Path, *argv: str, extra_env: dict | None = None) -> tuple[float, str]:
        return run(
            [*BUILDKIT, *argv, "xl", "--source", str(src), "--out", str(d / "out")],
            d,
            {**env, **(extra_env or {})},
        )

    a = project("writer")
    t_build, _ = bk(a, "build")
    objs = objects(a / "cache")
    total = sum(p.stat().st_size for p in objs)
    print(
        f"fixture {src_mb:.0f} MB bf16; xl built in {t_build:.1f}s; "
        f"{len(objs)} objects, {total / MB:.0f} MB"
    )

    rows = []
    server, endpoint = start_server()
    try:
        s3env = {"AWS_ENDPOINT_URL": endpoint}
        import boto3
        from boto3.s3.transfer import TransferConfig

        c = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
        )
        for b in ("bkbench", "rawbench"):
            c.create_bucket(Bucket=b)

        t_push, out = bk(a, "push", "--remote", "s3://bkbench/cache", extra_env=s3env)
        sent = int(re.search(r"listings, (\d+) bytes\)", out)[1])
        t_push2, _ = bk(a, "push", "--remote", "s3://bkbench/cache", extra_env=s3env)
        b_ = project("reader")
        bk(b_, "plan")  # hash the source in the new store: not part of the transfer
        t_pull, out = bk(b_, "pull", "--remote", "s3://bkbench/cache", extra_env=s3env)
        got = int(re.search(r": (\d+) bytes in", out)[1])

        from buildkit.store.remote import THREADS, S3Backend

        cfg: TransferConfig = S3Backend("s3://rawbench", "rawbench", "").transfer

        def up(p: Path):
            c.upload_file(str(p), "rawbench", str(p.relative_to(a / "cache")), Config=cfg)

        t = time.monotonic()
        with ThreadPoolExecutor(THREADS) as ex:
            list(ex.map(up, objs))
        t_raw_up = time.monotonic() - t
        dst = root / "raw-down"

        def down(p: Path):
            key = str(p.relative_to(a / "cache"))
            (dst / key).parent.mkdir(parents=True, exist_ok=True)
            c.download_file("rawbench", key, str(dst / key), Config=cfg)

        t = time.monotonic()
        with ThreadPoolExecutor(THREADS) as ex:
            list(ex.map(down, objs))
        t_raw_down = time.monotonic() - t
        rows += [
            ("s3 upload", "buildkit push", sent, t_push, "boto3 upload_file", t_raw_up),
            ("s3 download", "buildkit pull", got, t_pull, "boto3 download_file", t_raw_down),
        ]
        print(f"second push (nothing to send): {t_push2:.2f}s")
    finally:
        server.terminate()
        server.wait()

    url = (root / "shared").as_uri()
    t_fpush, out = bk(a, "push", "--remote", url)
    c_ = project("reader-file")
    bk(c_, "plan")
    t_fpull, _ = bk(c_, "pull", "--remote", url)
    t = time.monotonic()
    shutil.copytree(a / "cache" / "objects", root / "raw-copy")
    t_cp = time.monotonic() - t
    rows += [
        ("file upload", "buildkit push", total, t_fpush, "shutil.copytree", t_cp),
        ("file download", "buildkit pull", total, t_fpull, "(same copy)", t_cp),
    ]

    print(
        f"\n| remote | buildkit | MB | s | MB/s | raw | s | MB/s | buildkit : raw |\n|{'---|' * 9}"
    )
    for what, cmd, n, t, raw, tr in rows:
        print(
            f"| {what} | {cmd} | {n / MB:.0f} | {t:.2f} | {n / MB / t:.0f} | {raw} | {tr:.2f} | "
            f"{total / MB / tr:.0f} | {(n / t) / (total / tr):.2f} |"
        )
    print(
        "\nbuildkit times are whole commands (start-up, planning, hashing every object on push);"
        " raw times move the object files only."
    )


if __name__ == "__main__":
    main()
