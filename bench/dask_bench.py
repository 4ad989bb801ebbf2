"""``build --dask local:2`` against a local build of xl, once, on a fixture of a few hundred MB
(not in CI). Writes its table between the ``dask`` markers of bench/RESULTS.md.

Runs, each a cold store with the fixture in the page cache (generated just before):

1. local: ``buildkit build xl`` (two threads quantize);
2. ``--dask local:2``: the build starts a LocalCluster of 2 worker processes itself;
3. ``--dask tcp://…``: a LocalCluster started here first (so not in the build's time), with a
   scheduler plugin taking each task's compute time on its worker: the per-task figures an
   estimate for N machines starts from.

Wall, CPU (user + sys, the build and the processes it started and reaped) and peak RSS (the
largest single process) come from ``/usr/bin/time -v``; run 3's workers are the bench's
children, so its CPU and RSS are the client's only.

``--no-shared-disk``: the fixture (~2 GB at 28 layers) served by the loopback Hub
(tests/hubserver.py), a remote on moto's S3 server on loopback behind a proxy that counts the
bytes each way, and three builds of ``xl --source hf://…`` (the client's HF cache filled
first, not timed): local; ``--dask local:2`` (a shared disk); and a ``dask scheduler`` with two
``dask worker`` processes, each with its own ``BUILDKIT_STORE``, and ``--remote``. Bytes moved
are the Hub's ranged reads (the workers'), the remote's uploads and downloads (all machines'),
against the source's tensor bytes read once plus the published bytes. Its table goes between
the ``dask-remote`` markers.

Usage::

    python bench/dask_bench.py                  # ~400 MB fixture under build/dask-bench
    python bench/dask_bench.py --layers 12 --no-write
    python bench/dask_bench.py --no-shared-disk # ~2 GB fixture, workers without a shared disk
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILDKIT = [sys.executable, "-m", "buildkit.cli"]
MB = 1e6


def timed(argv: list[str], env: dict) -> dict:
    """Run argv under /usr/bin/time -v; wall, cpu, peak RSS and the step times it printed."""
    p = subprocess.run(
        ["/usr/bin/time", "-v", *map(str, argv)], capture_output=True, text=True, env=env
    )
    if p.returncode != 0:
        sys.exit(f"dask_bench: {' '.join(map(str, argv))} failed:\n{p.stderr[-4000:]}")

    def field(name):
        return re.search(rf"{re.escape(name)}: (.+)", p.stderr).group(1).strip()

    wall = 0.0
    for part in field("Elapsed (wall clock) time (h:mm:ss or m:ss)").split(":"):
        wall = wall * 60 + float(part)
    steps = {
        m[0]: float(m[1]) for m in re.findall(r"^\[done\]\s+(\S+) .* in ([\d.]+)s", p.stderr, re.M)
    }
    return {
        "wall": wall,
        "cpu": float(field("User time (seconds)")) + float(field("System time (seconds)")),
        "rss_mb": int(field("Maximum resident set size (kbytes)")) / 1e3,
        "steps": steps,
    }


def build(work: Path, name: str, src: Path, env: dict, *extra) -> dict:
    store, out = work / f"store-{name}", work / f"out-{name}"
    for d in (store, out):
        shutil.rmtree(d, ignore_errors=True)
    r = timed(
        [
            *BUILDKIT,
            "--store",
            store,
            "--manifests",
            work / "manifests",
            "build",
            "xl",
            "--source",
            src,
            "--out",
            out,
            *extra,
        ],
        env,
    )
    ref = json.loads((store / "refs" / "xl.json").read_text())
    r["outputs"] = {n: v["outputs"] for n, v in ref["nodes"].items()}
    r["store"] = store
    return r


def per_task(work: Path, src: Path, env: dict) -> tuple[dict, list[dict]]:
    """Build against a cluster started here; each quantize task's compute seconds and bytes."""
    from distributed import LocalCluster
    from distributed.diagnostics.plugin import SchedulerPlugin

    class Times(SchedulerPlugin):
        def __init__(self):
            self.seconds: dict[str, float] = {}

        def transition(self, key, start, finish, *args, **kwargs):
            if finish == "memory" and str(key).startswith("quantize_entry-"):
                self.seconds[str(key)] = sum(
                    s["stop"] - s["start"]
                    for s in kwargs.get("startstops", ())
                    if s["action"] == "compute"
                )

    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None
    ) as cluster:
        times = Times()
        cluster.scheduler.add_plugin(times, name="dask-bench-times")
        r = build(work, "dask-tcp", src, env, "--dask", cluster.scheduler_address)
    from buildkit.store.store import Store

    art = Store(r["store"]).get_artifact(r["outputs"]["sanitize"]["model"])
    tasks = []
    for key, s in times.seconds.items():
        name = key.split("-", 2)[2].rsplit("-", 1)[0]
        e = art.tensors[name]
        n = 2
        for d in e["shape"]:
            n *= d
        tasks.append({"tensor": name, "seconds": s, "bytes": n, "expert": ".switch_mlp." in name})
    return r, tasks


def task_cpu(store_dir: Path, outputs: dict) -> list[dict]:
    """Each routed-expert quantize task run here, one at a time: CPU seconds (process time) and
    wall, the figures an estimate can scale (a loaded machine stretches wall, not CPU)."""
    from buildkit.quant.quantize import quantize_entry
    from buildkit.quant.roles import Role
    from buildkit.store.store import Store

    store = Store(store_dir)
    art = store.get_artifact(outputs["sanitize"]["model"])
    role = Role(bits=6, group_size=64)
    out = []
    for name in sorted(n for n in art.tensors if ".switch_mlp." in n):
        c, w = time.process_time(), time.perf_counter()
        quantize_entry(store, name, art.tensors[name], role)
        e = art.tensors[name]
        out.append(
            {
                "tensor": name,
                "cpu": time.process_time() - c,
                "wall": time.perf_counter() - w,
                "bytes": 2 * e["shape"][0] * e["shape"][1] * e["shape"][2],
            }
        )
    return out[1:]  # the first pays mlx's import


def fixture(work: Path, layers: int, env: dict) -> Path:
    src = work / f"fixture-l{layers}"
    if not src.exists():
        subprocess.run(
            [
                *BUILDKIT,
                "fixture",
                src,
                "--hidden",
                "1024",
                "--layers",
                str(layers),
                "--experts",
                "16",
                "--moe-intermediate",
                "512",
                "--vocab",
                "16384",
                "--shards",
                "2",
            ],
            check=True,
            env=env,
        )
    return src


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=REPO / "build" / "dask-bench")
    ap.add_argument("--layers", type=int, help="fixture layers (6: ~400 MB of bf16; 28: ~2 GB)")
    ap.add_argument(
        "--no-shared-disk", action="store_true", help="workers with their own disks (see above)"
    )
    ap.add_argument(
        "--no-write", action="store_true", help="print the table, leave RESULTS.md alone"
    )
    args = ap.parse_args(argv)
    work = args.work.absolute()
    work.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    env.pop("BUILDKIT_DASK", None)
    shutil.rmtree(work / "manifests", ignore_errors=True)
    shutil.copytree(REPO / "manifests", work / "manifests", ignore=shutil.ignore_patterns("*.lock"))
    if args.no_shared_disk:
        from dask_remote_bench import no_shared_disk

        text, same = no_shared_disk(work, fixture(work, args.layers or 28, env), env, build)
        print(text)
        if not args.no_write:
            write_results(text, "dask-remote", "Distributed builds without a shared disk")
        return 0 if same else 1
    src = fixture(work, args.layers or 6, env)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))

    t0 = time.time()
    local = build(work, "local", src, env)
    dask = build(work, "dask-local2", src, env, "--dask", "local:2")
    tcp, tasks = per_task(work, src, env)
    same = local["outputs"] == dask["outputs"] == tcp["outputs"]
    cpu = task_cpu(local["store"], local["outputs"])

    def row(label, r):
        q = r["steps"].get("quantize", 0.0)
        return (
            f"| {label} | {r['wall']:.1f} s | {r['cpu']:.1f} s | {r['cpu'] / r['wall']:.2f} | "
            f"{r['rss_mb']:.0f} MB | {q:.1f} s |"
        )

    ex = [t for t in tasks if t["expert"]]
    rest = [t for t in tasks if not t["expert"]]

    def rate(ts):
        return sum(t["bytes"] for t in ts) / max(sum(t["seconds"] for t in ts), 1e-9) / MB

    serial_rate = sum(t["bytes"] for t in cpu) / sum(t["cpu"] for t in cpu) / MB
    lines = [
        f"Run of {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(t0))}, "
        f"{os.cpu_count()} cores; fixture {size / MB:.0f} MB bf16 "
        f"({args.layers} layers, 16 experts, hidden 1024), page cache warm; "
        f"`xl`, cold store. Outputs identical in all three runs: {'yes' if same else '**NO**'}.",
        "",
        "| run | wall | CPU | cores | peak RSS (one process) | quantize step |",
        "|---|---|---|---|---|---|",
        row("local (2 threads)", local),
        row("`--dask local:2` (cluster start included)", dask),
        row("`--dask tcp://` (cluster already up; client's CPU/RSS only)", tcp),
        "",
        "Per quantize task (compute on a worker, its fsyncs included), from run 3: "
        f"{len(tasks)} tasks; {len(ex)} routed-expert tensors, "
        f"median {sorted(t['seconds'] for t in ex)[len(ex) // 2]:.3f} s for "
        f"{ex[0]['bytes'] / MB:.1f} MB bf16, {rate(ex):.0f} MB/s of bf16 per worker thread; "
        f"the other {len(rest)}: {sum(t['seconds'] for t in rest):.2f} s in all, "
        f"{rate(rest):.0f} MB/s.",
        "",
        f"The same routed-expert tasks run one at a time in the bench process ({len(cpu)}): "
        f"{sum(t['cpu'] for t in cpu):.2f} s CPU, {sum(t['wall'] for t in cpu):.2f} s wall for "
        f"{sum(t['bytes'] for t in cpu) / MB:.0f} MB: {serial_rate:.0f} "
        f"MB of bf16 per CPU second.",
    ]
    text = "\n".join(lines)
    print(text)
    (work / "tasks.json").write_text(json.dumps({"dask": tasks, "serial": cpu}, indent=1))
    if not args.no_write:
        write_results(text, "dask", "Distributed builds")
    return 0 if same else 1


def write_results(text: str, marker: str, title: str) -> None:
    res = REPO / "bench" / "RESULTS.md"
    body = res.read_text()
    a, b = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    if a in body:
        body = body[: body.index(a)] + a + "\n" + text + "\n" + body[body.index(b) :]
    else:
        body += f"\n## {title} (`bench/dask_bench.py`)\n\n{a}\n{text}\n{b}\n"
    res.write_text(body)


if __name__ == "__main__":
    sys.exit(main())
