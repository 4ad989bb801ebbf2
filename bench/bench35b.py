"""The real model's scale: buildkit xl and xl-mtp against mlx_lm.convert on a 35B-shaped source.

The source is ``buildkit fixture --preset qwen3.6-35b-a3b --sparse``: the real checkpoint's
names and shapes in 26 shards (~72 GB apparent), each large tensor's first 4 KiB real and the
rest a hole, so it costs tens of MB of disk and reads at memory speed. One run measures, in this
order, each as a child process under ``/usr/bin/time -v`` (wall, CPU, peak RSS):

1. ``python -m mlx_lm convert --hf-path SRC --mlx-path OUT -q --q-bits 6 --q-group-size 64``,
   under ``prlimit --as`` (address-space limit, ``--mem-limit``) so it cannot take a shared
   machine down; its output is measured and deleted before buildkit runs (disk);
2. ``buildkit build xl`` into an empty store (verification included: verify and the load check;
   not eval, which convert has no counterpart of: the variants' publish takes no eval input);
3. ``buildkit build xl-mtp`` after it (the head only);
4. ``buildkit estimate`` of both, against the bytes the builds published;
5. eval, its own rows: ``buildkit eval`` of the published xl against the source, then
   ``buildkit build xl`` itself, whose eval step is all that is not cached (and publish).

Bytes read and written are ``rchar``/``wchar`` of ``/proc/<pid>/io`` of the exited
``/usr/bin/time`` process (a process's counters include its reaped children's), read before
it is reaped; disk used is ``du`` of the outputs (and of the store). Targets (issue 23): xl at
most 0.75 x convert's wall, peak RSS under 1 GB, bytes written within 1.1 x the published size.
The table goes to bench/RESULTS.md between its own markers. Not in CI: it needs ~65 GB of free
disk and ~10 minutes. ``make bench-35b``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from peer import convert_argv  # bench/ is the script's directory, first on sys.path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"
BEGIN, END = "<!-- bench35b: begin -->", "<!-- bench35b: end -->"
PY = sys.executable
GB = 1e9


def proc_io(pid: int) -> dict[str, int]:
    try:
        return {
            k: int(v)
            for k, v in (ln.split(":") for ln in Path(f"/proc/{pid}/io").read_text().splitlines())
        }
    except OSError:
        return {}


def time_v(text: str) -> dict:
    def field(label: str) -> str:
        m = re.search(rf"^\s*{re.escape(label)}: (.*)$", text, re.M)
        return m[1].strip() if m else "0"

    wall = 0.0
    for part in field("Elapsed (wall clock) time (h:mm:ss or m:ss)").split(":"):
        wall = wall * 60 + float(part)
    return {
        "wall": wall,
        "cpu": float(field("User time (seconds)")) + float(field("System time (seconds)")),
        "peak_rss": int(field("Maximum resident set size (kbytes)")) * 1024,
        "fs_out_bytes": int(field("File system outputs")) * 512,
    }


def disk_busy_ms() -> int:
    """Milliseconds the block devices have spent doing I/O since boot (/proc/diskstats)."""
    try:
        return sum(int(ln.split()[12]) for ln in Path("/proc/diskstats").read_text().splitlines())
    except (OSError, IndexError, ValueError):
        return 0


def settle_disk(quiet: float = 2.0, limit: float = 180.0) -> float:
    """Sync, then wait until the disks have done no I/O for ``quiet`` seconds (at most
    ``limit``), so that a run measured is not billed for the write-back or the trim (``/`` may
    be mounted with ``discard``) of the files the run before it wrote or deleted."""
    t0 = time.perf_counter()
    os.sync()
    last, since = disk_busy_ms(), time.perf_counter()
    while time.perf_counter() - t0 < limit:
        time.sleep(0.25)
        now = disk_busy_ms()
        if now != last:
            last, since = now, time.perf_counter()
        elif time.perf_counter() - since >= quiet:
            break
    return time.perf_counter() - t0


def measure(name: str, argv: list, logs: Path, limit: str | None = None) -> dict:
    """Run argv under /usr/bin/time -v (and prlimit --as if ``limit``) and return its figures."""
    logs.mkdir(parents=True, exist_ok=True)
    log, tfile = logs / f"{name}.log", logs / f"{name}.time"
    cmd = ["/usr/bin/time", "-v", "-o", str(tfile), *map(str, argv)]
    if limit:  # prlimit takes bytes (a "16G" suffix made it crash)
        n = (
            int(limit[:-1]) * 1024 ** " KMGT".index(limit[-1].upper())
            if limit[-1].isalpha()
            else int(limit)
        )
        cmd = ["prlimit", f"--as={n}", *cmd]
    settled = settle_disk()  # not billed for the previous run's write-back or deletions
    print(f"bench35b: {name}: {' '.join(map(str, argv))}", flush=True)
    with open(log, "w") as out:
        t0 = time.perf_counter()
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        outer_wall = time.perf_counter() - t0
        io = proc_io(child.pid)
        code = child.wait()
    text = log.read_text()
    r = {
        "name": name,
        "exit": code,
        "settle_s": settled,
        "outer_wall": outer_wall,
        "rchar": io.get("rchar", 0),
        "wchar": io.get("wchar", 0),
        **time_v(tfile.read_text() if tfile.exists() else ""),
        "steps": {
            m[1]: float(m[2]) for m in re.finditer(r"^\[done\]\s+(\S+) .* in ([\d.]+)s", text, re.M)
        },
    }
    if code != 0:
        r["error"] = text[-2000:]
        print(f"bench35b: {name} exited {code}; see {log}", flush=True)
    print(
        f"bench35b: {name}: {r['wall']:.1f} s wall, {r['cpu']:.1f} s CPU, "
        f"peak RSS {r['peak_rss'] / 1e6:.0f} MB",
        flush=True,
    )
    return r


def du(path: Path, apparent: bool = False) -> int:
    if not path.exists():
        return 0
    args = ["du", "-sb" if apparent else "-sB1", str(path)]
    return int(subprocess.run(args, capture_output=True, text=True, check=True).stdout.split()[0])


def tensor_bytes(out: Path) -> int:
    sys.path.insert(0, str(ROOT))
    from buildkit.formats.tensors import read_header

    return sum(i.nbytes for f in out.glob("*.safetensors") for i in read_header(f).tensors.values())


def machine() -> dict:
    cpu = re.search(r"^model name\s*:\s*(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    mem = re.search(r"^MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    from importlib.metadata import version

    return {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": cpu[1] if cpu else platform.processor(),
        "nproc": len(os.sched_getaffinity(0)),
        "ram_gb": round(int(mem[1]) * 1024 / 2**30, 1) if mem else None,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "mlx": version("mlx"),
        "mlx-lm": version("mlx-lm"),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
    }


def run(args) -> dict:
    work = Path(args.work).absolute()
    if work.exists():
        shutil.rmtree(work)
    logs, src, store, out = work / "logs", work / "src", work / "store", work / "out"
    bk = [PY, "-m", "buildkit.cli"]
    R: dict = {"machine": machine(), "mem_limit": args.mem_limit}
    R["fixture"] = measure(
        "fixture", [*bk, "fixture", src, "--preset", "qwen3.6-35b-a3b", "--sparse"], logs
    )
    R["source"] = {"apparent": du(src, True), "disk": du(src)}
    if not args.skip_convert:
        conv_out = work / "convert"
        R["convert"] = measure(
            "convert",
            convert_argv(src, conv_out, PY),
            logs,
            limit=args.mem_limit,
        )
        R["convert"]["published"] = tensor_bytes(conv_out) if conv_out.exists() else 0
        R["convert"]["disk"] = du(conv_out)
        shutil.rmtree(conv_out, ignore_errors=True)
    # Grading is not part of this comparison (convert grades nothing, and eval at this scale is
    # CPU-hours of forward passes over random weights): the same variants, publish without
    # eval inputs, built up to publish. Verify and the load check stay.
    manifests = work / "manifests"
    shutil.copytree(ROOT / "manifests", manifests)
    for v in ("xl", "xl-mtp"):
        (manifests / f"{v}-noeval.toml").write_text(
            f'extends = "{v}"\n[steps.publish.inputs]\neval = []\n'
        )
    for v in ("xl", "xl-mtp"):
        r = measure(
            v,
            [
                *bk,
                "--store",
                store,
                "--manifests",
                manifests,
                "build",
                f"{v}-noeval",
                "--target",
                "publish",
                "--source",
                src,
                "--out",
                out / v,
                "-j",
                "2",
            ],
            logs,
        )
        r["published"] = tensor_bytes(out / v)
        r["out_disk"] = du(out / v)
        r["store_disk"] = du(store)
        est = subprocess.run(
            [*bk, "--manifests", str(manifests), "estimate", v, "--source", str(src), "--json"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        r["estimate"] = (
            json.loads(est.stdout) if est.returncode == 0 else {"error": est.stderr[-500:]}
        )
        R[v] = r
    # eval as its own rows: `buildkit eval` of the published xl against the source, and the
    # variant's own build with its eval step (everything else cached by the run above)
    R["eval_cli"] = measure(
        "eval",
        [*bk, "eval", out / "xl", "--source", src, "--max-tokens", args.eval_tokens, "--json"],
        logs,
    )
    R["eval_build"] = measure(
        "xl-eval",
        [
            *bk,
            "--store",
            store,
            "--manifests",
            manifests,
            "build",
            "xl",
            "--source",
            src,
            "--out",
            out / "xl-eval",
        ],
        logs,
    )
    R["eval_tokens"] = args.eval_tokens
    R["disk_total"] = du(work)
    if not args.keep:
        shutil.rmtree(work)
    return R


def report(R: dict) -> str:
    M, xl, mtp, conv = R["machine"], R["xl"], R["xl-mtp"], R.get("convert")

    def row(label: str, r: dict, published: int) -> str:
        return (
            f"| {label} | {r['wall']:.1f} | {r['cpu']:.1f} | {r['peak_rss'] / 1e6:,.0f} | "
            f"{r['rchar'] / GB:.2f} | "
            f"{r['wchar'] / GB:.2f} | {published / GB:.2f} | "
            f"{r.get('out_disk', r.get('disk', 0)) / GB:.2f} |"
            + (" exit " + str(r["exit"]) if r["exit"] else "")
        )

    L = [
        f"## 35B-shaped sparse source (`make bench-35b`, `bench/bench35b.py`), {M['date']}",
        "",
        f"Machine: {M['cpu']}, {M['nproc']} cores, {M['ram_gb']} GiB; Linux {M['kernel']}; "
        f"Python {M['python']}; "
        f"mlx {M['mlx']}, mlx-lm {M['mlx-lm']}; buildkit {M['commit']}. "
        "Source: `buildkit fixture --preset "
        f"qwen3.6-35b-a3b --sparse`, {R['source']['apparent'] / GB:.1f} GB apparent, "
        f"{R['source']['disk'] / 1e6:.0f} MB on disk "
        f"(written in {R['fixture']['wall']:.1f} s). "
        f"mlx_lm.convert ran under `prlimit --as={R['mem_limit']}`.",
        "",
        "| run | wall s | CPU s | peak RSS MB | read GB | written GB | published GB "
        "| output on disk GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    if conv:
        L.append(row("mlx_lm.convert -q --q-bits 6 --q-group-size 64", conv, conv["published"]))
    L.append(row("buildkit build xl (cold, verify + load check)", xl, xl["published"]))
    L.append(row("buildkit build xl-mtp (after xl)", mtp, mtp["published"]))
    ev, evb = R.get("eval_cli"), R.get("eval_build")
    if ev:
        L.append(row(f"buildkit eval xl --source SRC --max-tokens {R['eval_tokens']}", ev, 0))
    if evb:
        L.append(row("buildkit build xl (after xl: its eval step and publish)", evb, 0))
    L += [
        "",
        f"buildkit store after both: {mtp['store_disk'] / GB:.2f} GB on disk; "
        "the whole bench directory "
        f"{R['disk_total'] / GB:.2f} GB (convert's output already deleted).",
        "",
        "Before each run the disks settled (sync, then no I/O for 2 s): waited "
        + ", ".join(
            f"{R[k]['settle_s']:.1f} s before {k}"
            for k in ("convert", "xl", "xl-mtp")
            if k in R and "settle_s" in R[k]
        )
        + ".",
        "",
        "Per-step times (s): "
        + "; ".join(
            f"{v}: " + ", ".join(f"{k} {t:.1f}" for k, t in R[v]["steps"].items())
            for v in ("xl", "xl-mtp")
        ),
        "",
    ]
    for v in ("xl", "xl-mtp"):
        e = R[v]["estimate"]
        if "bytes" in e:
            d = e["bytes"] - R[v]["published"]
            L.append(
                f"- `buildkit estimate {v}`: {e['bytes']:,} bytes "
                f"({e['bits_per_weight']:.3f} bpw with the vision "
                f"tower, {e['bits_per_weight_text']:.3f} text only) "
                f"against {R[v]['published']:,} published tensor "
                f"bytes: {'equal' if d == 0 else f'off by {d:,}'}."
            )
    L.append("")
    if conv and conv["exit"] == 0:
        ratio = xl["wall"] / conv["wall"]
        L.append(
            f"- Target xl wall <= 0.75 x convert: {ratio:.2f} x "
            f"({xl['wall']:.1f} / {conv['wall']:.1f} s): "
            f"{'met' if ratio <= 0.75 else '**MISSED**'}."
        )
    elif conv:
        L.append(f"- mlx_lm.convert did not finish (exit {conv['exit']}); no wall ratio.")
    L.append(
        f"- Target peak RSS < 1 GB: xl {xl['peak_rss'] / 1e6:,.0f} MB, "
        f"xl-mtp {mtp['peak_rss'] / 1e6:,.0f} MB: "
        f"{'met' if max(xl['peak_rss'], mtp['peak_rss']) < 1e9 else '**MISSED**'}."
    )
    if evb and "eval" in evb["steps"]:
        t = evb["steps"]["eval"]
        L.append(
            f"- Target xl's eval step <= 0.5 x the build's wall and peak RSS < 1 GB: "
            f"{t / xl['wall']:.2f} x ({t:.1f} / {xl['wall']:.1f} s), "
            f"{evb['peak_rss'] / 1e6:,.0f} MB: "
            f"{'met' if t <= 0.5 * xl['wall'] and evb['peak_rss'] < 1e9 else '**MISSED**'}."
        )
    w = xl["wchar"] / max(xl["published"], 1)
    L.append(
        f"- Target bytes written <= 1.1 x published (xl): {w:.2f} x ({xl['wchar'] / GB:.2f} / "
        f"{xl['published'] / GB:.2f} GB): {'met' if w <= 1.1 else '**MISSED**'}."
    )
    return "\n".join(L) + "\n"


def write_results(text: str) -> None:
    block = f"{BEGIN}\n{text}{END}\n"
    old = RESULTS.read_text() if RESULTS.exists() else ""
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        RESULTS.write_text(head + block + rest.split(END, 1)[1].lstrip("\n"))
    else:
        RESULTS.write_text(old.rstrip("\n") + "\n\n" + block)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--work",
        default=str(ROOT / "build" / "bench35b"),
        help="scratch directory (deleted first and after)",
    )
    p.add_argument(
        "--mem-limit", default="16G", help="prlimit --as for mlx_lm.convert (default 16G)"
    )
    p.add_argument("--skip-convert", action="store_true", help="buildkit only")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument(
        "--eval-tokens", default="128", help="`buildkit eval --max-tokens` (default 128)"
    )
    p.add_argument(
        "--no-results", action="store_true", help="print the table instead of writing RESULTS.md"
    )
    args = p.parse_args(argv)
    R = run(args)
    (ROOT / "build").mkdir(exist_ok=True)
    (ROOT / "build" / "bench35b.json").write_text(json.dumps(R, indent=2))
    text = report(R)
    print(text)
    if not args.no_results:
        write_results(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
