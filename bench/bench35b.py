"""The real model's scale: every shipped variant built as users build it, and buildkit against
mlx_lm.convert, on a 35B-shaped source.

The source is ``buildkit fixture --preset qwen3.6-35b-a3b --sparse``: the real checkpoint's
names and shapes in 26 shards (~72 GB apparent), each large tensor's first 4 KiB real and the
rest a hole, so it costs tens of MB of disk and reads at memory speed. Its hidden states are
mostly zeros, so its routers send every token to the same 8 experts a layer; ``--dense
--layers N`` writes N layers of the same shapes whole (random weights, ~2 GB a layer), where
every expert is reached, for GPTQ's time a layer at real routing. One run measures, in this
order, each as a child process under ``/usr/bin/time -v`` (wall, CPU, peak RSS), with each
step's wall (its ``[done]`` line) and peak RSS (the build's RSS sampled every 0.1 s, charged to
the steps running then: with ``-j 2`` an upper bound where two overlap):

1. ``python -m mlx_lm convert --hf-path SRC --mlx-path OUT -q --q-bits 6 --q-group-size 64``,
   under ``prlimit --as`` (address-space limit, ``--mem-limit``) so it cannot take a shared
   machine down; its output is measured and deleted before buildkit runs (disk);
2. the comparison with convert: ``xl-noeval`` into an empty store, then ``xl-mtp-noeval`` after
   it (publish without eval inputs: convert grades nothing; verify and the load check stay),
   ``buildkit estimate`` of both against the bytes they published, and ``buildkit eval`` of
   the published xl against the source;
3. the variants as shipped (``--variants``; eval steps included): ``xl`` cold in its own store,
   ``xl-mtp`` after it in the same store, ``oq4e-mtp-xl`` cold in its own (its donor the same
   source) and ``oq`` cold in its own. Each shipped build's eval.json says whether mlx_vlm's
   speculative run fitted in memory: the bytes it may take are ``--client-memory`` (2 GB by
   default, the builds' target, so at 35B it does not run; ``machine`` as a user's build).

Bytes read and written are ``rchar``/``wchar`` of ``/proc/<pid>/io`` of the exited
``/usr/bin/time`` process (a process's counters include its reaped children's), read before
it is reaped; disk used is ``du`` of the outputs (and of the store). Targets: issue 23 (xl at
most 0.75 x convert's wall, bytes written within 1.1 x the published size) and issue 41 (every
peak under 2 GB; xl-mtp after xl <= 0.25 x xl cold; oq4e-mtp-xl cold <= 3 x xl cold; oq cold
<= 5 x xl cold; xl's eval step <= 0.5 x xl-noeval's build; within 1.5 x its floor where a
target is below it: the TFLOP of matmuls each forward-pass step logs, at the sgemm rate on two
threads measured at the start of the run). The table goes to bench/RESULTS.md
between its own markers. Not in CI: it needs ~65 GB of free disk and hours (oq's sensitivity).
``make bench-35b``; ``--preset small --skip-convert`` checks the script in a minute.
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
import threading
import time
from pathlib import Path

from peer import convert_argv  # bench/ is the script's directory, first on sys.path

from buildkit.clients.speculative import MEMORY_ENV

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"
BEGIN, END = "<!-- bench35b: begin -->", "<!-- bench35b: end -->"
PY = sys.executable
GB = 1e9
VARIANTS = ("xl", "xl-mtp", "oq4e-mtp-xl", "oq")  # as shipped, in build order
STEP_LINE = re.compile(r"^\[(run|done|failed)\]\s+(\S+)")
# a forward-pass step's own count of its matmuls, as its log line says it (``checkpoint.matmuls``)
TFLOP_LINE = re.compile(r"^\s+(\S+): .*~([\d.]+) TFLOP of matmuls", re.M)
# float32 matmuls on two threads, as the steps run them (numpy's BLAS on one thread each, as
# the CLI sets it): the rate a forward pass's floor is counted at
SGEMM = """
import threading, time, numpy as np
a, b = np.random.rand(2048, 2048).astype(np.float32), np.random.rand(2048, 1024).astype(np.float32)
a @ b
def work():
    for _ in range(8):
        a @ b
t = time.perf_counter()
ts = [threading.Thread(target=work) for _ in range(2)]
[x.start() for x in ts]
[x.join() for x in ts]
print(2 * 8 * 2 * 2048 * 2048 * 1024 / (time.perf_counter() - t) / 1e9)
"""


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


MEMORY = ("VmRSS", "RssAnon", "VmHWM")  # the /proc status fields the sampler reads


def tree_memory(pid: int) -> dict[str, int]:
    """A process and all its descendants (/proc): resident bytes (``VmRSS``), of them anonymous
    (``RssAnon``), each summed, and the largest high-water mark (``VmHWM``, what ``time -v``
    reports): a sampled peak above the recorded one then says what it was made of."""
    got, todo = dict.fromkeys(MEMORY, 0), [pid]
    while todo:
        p = todo.pop()
        try:
            for ln in Path(f"/proc/{p}/status").read_text().splitlines():
                key, _, value = ln.partition(":")
                if key in got:
                    n = int(value.split()[0]) * 1024
                    got[key] = max(got[key], n) if key == "VmHWM" else got[key] + n
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return got


class StepPeaks(threading.Thread):
    """Per step, the peak RSS of the build while the step ran: the process tree's RSS every
    0.1 s, charged to every step whose ``[run]`` line the log shows and ``[done]`` line not
    yet."""

    def __init__(self, pid: int, log: Path):
        super().__init__(daemon=True)
        self.pid, self.log, self.at = pid, log, 0
        self.running: set[str] = set()
        self.peaks: dict[str, int] = {}
        self.top = dict.fromkeys(MEMORY, 0)  # the sample of the highest VmRSS
        self.done = threading.Event()

    def read_log(self) -> None:
        with open(self.log, "rb") as f:
            f.seek(self.at)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # whole lines only
        self.at += end
        for ln in chunk[:end].decode(errors="replace").splitlines():
            if m := STEP_LINE.match(ln):
                (self.running.add if m[1] == "run" else self.running.discard)(m[2])

    def run(self) -> None:
        while not self.done.wait(0.1):
            self.read_log()
            mem = tree_memory(self.pid)
            rss = mem["VmRSS"]
            if rss > self.top["VmRSS"]:
                self.top = mem
            for step in self.running:
                self.peaks[step] = max(self.peaks.get(step, 0), rss)


def measure(
    name: str,
    argv: list,
    logs: Path,
    limit: str | None = None,
    timeout: float | None = None,
    env: dict | None = None,
) -> dict:
    """Run argv under /usr/bin/time -v (and prlimit --as if ``limit``; ``env`` added to the
    environment) and return its figures."""
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
        child = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        peaks = StepPeaks(child.pid, log)
        peaks.start()
        killer = threading.Timer(timeout, os.killpg, (child.pid, 9)) if timeout else None
        if killer:
            killer.start()
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        outer_wall = time.perf_counter() - t0
        io = proc_io(child.pid)
        code = child.wait()
        if killer:
            killer.cancel()
        peaks.done.set()
        peaks.join()
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
        "step_peak_rss": peaks.peaks,
        "tflop": {m[1]: float(m[2]) for m in TFLOP_LINE.finditer(text)},
        "sampled_peak": peaks.top,
    }
    if timeout and outer_wall >= timeout:
        r["timeout"] = timeout
    if code != 0:
        r["error"] = text[-2000:]
        print(f"bench35b: {name} exited {code}; see {log}", flush=True)
    print(
        f"bench35b: {name}: {r['wall']:.1f} s wall, {r['cpu']:.1f} s CPU, "
        f"peak RSS {r['peak_rss'] / 1e6:.0f} MB (sampled: VmRSS {peaks.top['VmRSS'] / 1e6:.0f} MB, "
        f"{peaks.top['RssAnon'] / 1e6:.0f} MB anonymous, VmHWM {peaks.top['VmHWM'] / 1e6:.0f} MB)",
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


def build_argv(store: Path, manifests: Path, variant: str, src: Path, out: Path, *extra) -> list:
    bk = [PY, "-m", "buildkit.cli", "--store", store, "--manifests", manifests]
    return [*bk, "build", variant, "--source", src, "--out", out, *extra]


def estimate(manifests: Path, variant: str, src: Path) -> dict:
    est = subprocess.run(
        [PY, "-m", "buildkit.cli", "--manifests", str(manifests), "estimate", variant]
        + ["--source", str(src), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return json.loads(est.stdout) if est.returncode == 0 else {"error": est.stderr[-500:]}


def write_manifests(work: Path, src: Path) -> Path:
    """The shipped manifests, the ``-noeval`` twins (publish without eval inputs) and
    oq4e-mtp-xl with its donor the same source (as bench35b's one source)."""
    manifests = work / "manifests"
    shutil.copytree(ROOT / "manifests", manifests, ignore=shutil.ignore_patterns("*.lock"))
    for v in ("xl", "xl-mtp"):
        (manifests / f"{v}-noeval.toml").write_text(
            f'extends = "{v}"\n[steps.publish.inputs]\neval = []\n'
        )
    (manifests / "oq4e-mtp-xl-samesrc.toml").write_text(
        f'extends = "oq4e-mtp-xl"\n[steps.donor_fetch]\nparams.source = "{src}"\n'
    )
    return manifests


def noeval_rows(R: dict, args, work: Path, src: Path, manifests: Path) -> None:
    """xl-noeval cold and xl-mtp-noeval after it (the comparison with convert), their
    estimates, and ``buildkit eval`` of the published xl; then their store is deleted."""
    logs, store, out = work / "logs", work / "store-noeval", work / "out-noeval"
    for v in ("xl", "xl-mtp"):
        argv = build_argv(store, manifests, f"{v}-noeval", src, out / v, "--target", "publish")
        r = measure(f"{v}-noeval", [*argv, "-j", "2"], logs)
        r |= {"published": tensor_bytes(out / v), "out_disk": du(out / v)}
        r |= {"store_disk": du(store), "estimate": estimate(manifests, v, src)}
        R[v] = r
    R["eval_cli"] = measure(
        "eval",
        [PY, "-m", "buildkit.cli", "eval", out / "xl", "--source", src]
        + ["--max-tokens", args.eval_tokens, "--json"],
        logs,
    )
    R["eval_tokens"] = args.eval_tokens
    R["disk_noeval"] = du(work)
    shutil.rmtree(store)
    shutil.rmtree(out)


def speculative_status(out: Path) -> str:
    """What a published variant's eval.json says of mlx_vlm's speculative run."""
    try:
        s = json.loads((out / "eval.json").read_text()).get("speculative")
    except (OSError, ValueError):
        return "no eval.json"
    if not s:
        return "-"
    if "skipped" in s:
        return f"not run: {s['skipped']}"
    tpr = "/".join("-" if x is None else f"{x:.2f}" for x in s["tokens_per_round"])
    stop = ", stopped early: the head accepted nothing" if s.get("stopped_early") else ""
    return f"ran ({'lossless' if s['lossless'] else 'NOT LOSSLESS'}, tokens per round {tpr}{stop})"


def shipped_rows(R: dict, args, work: Path, src: Path, manifests: Path) -> None:
    """The variants as shipped, eval steps included: xl cold and xl-mtp after it in one store,
    oq4e-mtp-xl and oq cold in their own; each store deleted once measured (disk)."""
    logs, R["shipped"] = work / "logs", {}
    stores = {"xl": "store-xl", "xl-mtp": "store-xl"}
    for v in args.variants:
        store, out = work / stores.get(v, f"store-{v}"), work / "out" / v
        name = "oq4e-mtp-xl-samesrc" if v == "oq4e-mtp-xl" else v
        env = {} if args.client_memory == "machine" else {MEMORY_ENV: args.client_memory}
        argv = build_argv(store, manifests, name, src, out)
        r = measure(v, argv, logs, timeout=args.timeout, env=env)
        r |= {"published": tensor_bytes(out) if out.exists() else 0, "store_disk": du(store)}
        r["speculative"] = speculative_status(out)
        r["after_xl"] = v == "xl-mtp" and "xl" in R["shipped"]
        R["shipped"][v] = r
        shutil.rmtree(out, ignore_errors=True)
        if v != "xl" or "xl-mtp" not in args.variants:
            shutil.rmtree(store, ignore_errors=True)


def sgemm_gflops() -> float:
    """The machine's float32 matmul rate on two threads (``SGEMM``), best of three."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    runs = [
        subprocess.run([PY, "-c", SGEMM], env=env, capture_output=True, text=True) for _ in "123"
    ]
    return max(float(r.stdout) for r in runs)


def run(args) -> dict:
    work = Path(args.work).absolute()
    if work.exists():
        shutil.rmtree(work)
    logs, src = work / "logs", work / "src"
    preset = ["--preset", args.preset] if args.preset != "small" else []
    if args.layers:  # a shorter trunk of the same shapes, in minutes: the memory of every step
        preset += ["--layers", str(args.layers), "--shards", "4"]  # (26 would leave some empty)
    R: dict = {"machine": machine(), "mem_limit": args.mem_limit, "preset": args.preset}
    R["client_memory"], R["dense"] = args.client_memory, args.dense
    R["sgemm_gflops"] = sgemm_gflops()
    sparse = [] if args.dense else ["--sparse"]
    R["fixture"] = measure(
        "fixture", [PY, "-m", "buildkit.cli", "fixture", src, *preset, *sparse], logs
    )
    if R["fixture"]["exit"]:  # nothing to build from; its log says why
        sys.exit(f"bench35b: the fixture failed:\n{R['fixture']['error']}")
    R["source"] = {"apparent": du(src, True), "disk": du(src)}
    R["layers"] = json.loads((src / "config.json").read_text())["text_config"]["num_hidden_layers"]
    if not args.skip_convert:
        conv_out = work / "convert"
        R["convert"] = measure("convert", convert_argv(src, conv_out, PY), logs, args.mem_limit)
        R["convert"]["published"] = tensor_bytes(conv_out) if conv_out.exists() else 0
        R["convert"]["disk"] = du(conv_out)
        shutil.rmtree(conv_out, ignore_errors=True)
    manifests = write_manifests(work, src)
    noeval_rows(R, args, work, src, manifests)
    shipped_rows(R, args, work, src, manifests)
    R["disk_total"] = du(work)
    if not args.keep:
        shutil.rmtree(work)
    return R


def row(label: str, r: dict, published: int) -> str:
    return (
        f"| {label} | {r['wall']:.1f} | {r['cpu']:.1f} | {r['peak_rss'] / 1e6:,.0f} | "
        f"{r['rchar'] / GB:.2f} | "
        f"{r['wchar'] / GB:.2f} | {published / GB:.2f} | "
        f"{r.get('out_disk', r.get('disk', 0)) / GB:.2f} |"
        + (" exit " + str(r["exit"]) if r["exit"] else "")
        + (f" killed at the {r['timeout']:.0f} s timeout" if "timeout" in r else "")
    )


def header(R: dict) -> list[str]:
    M = R["machine"]
    return [
        f"## {R['preset']}-shaped {'dense' if R.get('dense') else 'sparse'} source "
        f"(`make bench-35b`, `bench/bench35b.py`), {M['date']}",
        "",
        f"Machine: {M['cpu']}, {M['nproc']} cores, {M['ram_gb']} GiB; Linux {M['kernel']}; "
        f"Python {M['python']}; "
        f"mlx {M['mlx']}, mlx-lm {M['mlx-lm']}; buildkit {M['commit']}. "
        f"Source: `buildkit fixture --preset {R['preset']}"
        + (f" --layers {R['layers']}`" if R.get("dense") else " --sparse`")
        + ", "
        f"{R['source']['apparent'] / GB:.1f} GB apparent, "
        f"{R['source']['disk'] / 1e6:.0f} MB on disk "
        f"(written in {R['fixture']['wall']:.1f} s). "
        + (
            f"mlx_lm.convert ran under `prlimit --as={R['mem_limit']}`."
            if "convert" in R
            else "mlx_lm.convert was not run (`--skip-convert`)."
        ),
        "",
    ]


def noeval_table(R: dict) -> list[str]:
    xl, mtp, conv, ev = R["xl"], R["xl-mtp"], R.get("convert"), R.get("eval_cli")
    L = [
        "Against mlx_lm.convert (publish without eval inputs):",
        "",
        "| run | wall s | CPU s | peak RSS MB | read GB | written GB | published GB "
        "| output on disk GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    if conv:
        L.append(row("mlx_lm.convert -q --q-bits 6 --q-group-size 64", conv, conv["published"]))
    L.append(row("buildkit build xl-noeval (cold, verify + load check)", xl, xl["published"]))
    L.append(row("buildkit build xl-mtp-noeval (after xl-noeval)", mtp, mtp["published"]))
    if ev:
        L.append(row(f"buildkit eval xl --source SRC --max-tokens {R['eval_tokens']}", ev, 0))
    L += ["", f"Their store: {mtp['store_disk'] / GB:.2f} GB on disk.", ""]
    for v in ("xl", "xl-mtp"):
        e = R[v]["estimate"]
        if "bytes" in e:
            d = e["bytes"] - R[v]["published"]
            L.append(
                f"- `buildkit estimate {v}`: {e['bytes']:,} bytes "
                f"({e['bits_per_weight']:.3f} bpw with the vision tower, "
                f"{e['bits_per_weight_text']:.3f} text only) against {R[v]['published']:,} "
                f"published tensor bytes: {'equal' if d == 0 else f'off by {d:,}'}."
            )
    return [*L, ""]


def shipped_table(R: dict) -> list[str]:
    S = R["shipped"]
    L = [
        "The variants as shipped (eval steps included; each cold in its own store, xl-mtp "
        f"after xl in xl's; mlx_vlm's whole-model run given {R.get('client_memory', 'machine')}"
        " bytes, `--client-memory`):",
        "",
        "| run | wall s | CPU s | peak RSS MB | read GB | written GB | published GB "
        "| mlx_vlm speculative run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v, r in S.items():
        label = f"buildkit build {v} ({'after xl' if r['after_xl'] else 'cold'})"
        cells = row(label, r, r["published"]).rsplit("|", 2)
        L.append(cells[0] + f"| {r['speculative']} |" + cells[2])
    L += [
        "",
        "Per step, wall s / peak RSS MB (the build's while the step ran; - : shorter than a "
        "sample):",
        "",
    ]
    for v, r in S.items():
        peaks = r["step_peak_rss"]
        L.append(
            f"- {v}: "
            + ", ".join(
                f"{k} {t:.1f} / " + (f"{peaks[k] / 1e6:,.0f}" if k in peaks else "-")
                for k, t in r["steps"].items()
            )
        )
    q = S.get("oq4e-mtp-xl", {}).get("steps", {}).get("quantize")
    if q is not None:
        L.append(f"- GPTQ (oq4e-mtp-xl's quantize): {q / R['layers']:.1f} s a layer.")
    return [*L, ""]


def floors(R: dict) -> list[str]:
    """Each shipped build against its forward passes' arithmetic: the TFLOP its steps count
    (their logs) at the machine's sgemm rate. A lower bound: GPTQ's factorizations, the
    quantizers' searches and every read are not in it."""
    rate = R.get("sgemm_gflops")
    S = {v: r for v, r in R.get("shipped", {}).items() if r.get("tflop")}
    if not rate or not S:
        return []
    L = [
        f"Floors: the forward passes' matmuls each step counts (its log's ~TFLOP) at this "
        f"machine's float32 sgemm on two threads, {rate:.0f} GFLOP/s ([2048, 2048] x "
        "[2048, 1024], measured at the start of the run); GPTQ, the searches and the reads are "
        "not counted, so a floor is a lower bound, and steps that overlap share the cores:",
        "",
    ]
    for v, r in S.items():
        total = sum(r["tflop"].values())
        floor = total * 1e3 / rate
        parts = ", ".join(
            f"{k} {t:.3g} TFLOP {r['steps'].get(k, 0) / (t * 1e3 / rate):.2f} x"
            for k, t in r["tflop"].items()
            if t > 0
        )
        L.append(
            f"- {v}: {total:.3g} TFLOP, floor {floor:.3g} s; the build {r['wall'] / floor:.2f} x "
            f"its floor ({parts})."
        )
    return [*L, ""]


def met(ok: bool) -> str:
    return "met" if ok else "**MISSED**"


def targets(R: dict) -> list[str]:
    xl, conv, S = R["xl"], R.get("convert"), R.get("shipped", {})
    L = []
    if conv and conv["exit"] == 0:
        ratio = xl["wall"] / conv["wall"]
        L.append(
            f"- Target xl-noeval wall <= 0.75 x convert: {ratio:.2f} x "
            f"({xl['wall']:.1f} / {conv['wall']:.1f} s): {met(ratio <= 0.75)}."
        )
    elif conv:
        L.append(f"- mlx_lm.convert did not finish (exit {conv['exit']}); no wall ratio.")
    w = xl["wchar"] / max(xl["published"], 1)
    L.append(
        f"- Target bytes written <= 1.1 x published (xl-noeval): {w:.2f} x "
        f"({xl['wchar'] / GB:.2f} / {xl['published'] / GB:.2f} GB): {met(w <= 1.1)}."
    )
    runs = {f"{v}-noeval": R[v] for v in ("xl", "xl-mtp")} | S
    # a run's peak: time -v's, or the sampler's where it saw more (a step's tree, file pages)
    peak = {
        k: max(r["peak_rss"], r.get("sampled_peak", {}).get("VmRSS", 0)) for k, r in runs.items()
    }
    worst = max(runs, key=peak.get)
    L.append(
        f"- Target every peak RSS < 2 GB (time -v's or the sampled VmRSS, the larger): the "
        f"highest {worst} {peak[worst] / 1e6:,.0f} MB: {met(peak[worst] < 2e9)}."
    )
    ok = {v: r for v, r in S.items() if r["exit"] == 0}
    if "xl" in ok:
        base = ok["xl"]["wall"]
        for v, limit in (("xl-mtp", 0.25), ("oq4e-mtp-xl", 3.0), ("oq", 5.0)):
            if v in ok and (v != "xl-mtp" or ok[v]["after_xl"]):
                x = ok[v]["wall"] / base
                L.append(
                    f"- Target {v} {'after xl' if v == 'xl-mtp' else 'cold'} <= {limit:g} x "
                    f"xl cold: {x:.2f} x ({ok[v]['wall']:.1f} / {base:.1f} s): {met(x <= limit)}."
                )
        if "eval" in ok["xl"]["steps"]:
            t = ok["xl"]["steps"]["eval"]
            L.append(
                f"- Target xl's eval step <= 0.5 x xl-noeval's build: {t / xl['wall']:.2f} x "
                f"({t:.1f} / {xl['wall']:.1f} s): {met(t <= 0.5 * xl['wall'])}."
            )
    L += [
        f"- {v}: did not finish (exit {r['exit']}): "
        + next((ln for ln in reversed(r.get("error", "").splitlines()) if ln.strip()), "?")
        for v, r in S.items()
        if r["exit"]
    ]
    return L


def report(R: dict) -> str:
    L = header(R) + noeval_table(R)
    L += (shipped_table(R) + floors(R)) if R.get("shipped") else []
    L += targets(R)
    return "\n".join(L) + "\n"


def write_results(text: str) -> None:
    block = f"{BEGIN}\n{text}{END}\n"
    old = RESULTS.read_text() if RESULTS.exists() else ""
    if BEGIN in old and END in old:
        end = old.index(END)
        start = old.rindex(BEGIN, 0, end)  # the marker that opens this block
        RESULTS.write_text(old[:start] + block + old[end + len(END) :].lstrip("\n"))
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
    p.add_argument(
        "--preset",
        default="qwen3.6-35b-a3b",
        help="the fixture's preset (default qwen3.6-35b-a3b); 'small': the generator's "
        "default dimensions, to check this script in a minute",
    )
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        type=lambda v: [x for x in VARIANTS if x in v.split(",")],
        help=f"the shipped variants to build (default {','.join(VARIANTS)}; "
        "xl-mtp after xl when both)",
    )
    p.add_argument(
        "--timeout", type=float, default=None, help="kill a shipped build after this many s"
    )
    p.add_argument(
        "--client-memory",
        default="2e9",
        help=f"{MEMORY_ENV} for the shipped builds: the bytes mlx_vlm's whole-model run may "
        "take (default 2e9, the builds' target: at 35B it is then not run; 'machine': what "
        "the machine has, as a user's build decides; oq's 16.5 GB fits this one's 23.5 GiB)",
    )
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="the source's decoder layers (default the preset's)",
    )
    p.add_argument(
        "--eval-tokens", default="128", help="`buildkit eval --max-tokens` (default 128)"
    )
    p.add_argument(
        "--no-results", action="store_true", help="print the table instead of writing RESULTS.md"
    )
    p.add_argument(
        "--dense",
        action="store_true",
        help="write every weight (random, not a hole): every expert is reached, as by the "
        "real model's routing, so GPTQ's time a layer is real; needs --layers (the whole "
        "preset would be 72 GB; ~2 GB a layer)",
    )
    args = p.parse_args(argv)
    if args.dense and not args.layers:
        p.error("--dense needs --layers N (each of the preset's layers is ~2 GB on disk)")
    if not args.variants:
        p.error(f"--variants: none of {', '.join(VARIANTS)}")
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
