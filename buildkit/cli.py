"""The ``buildkit`` command line. Exit codes: 0 ok, 1 build failed, 2 bad usage or bad manifest."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from pathlib import Path

from . import allocator, keys, uptodate
from .errors import BuildkitError, UsageError

EPILOG = """\
examples:
  buildkit build xl-mtp                     build the variant in manifests/xl-mtp.toml
  buildkit build xl --source hf://Qwen/Qwen3.6-35B-A3B@<sha> --out out/xl-35b
  buildkit plan xl-mtp                      what would run, and why
  buildkit explain xl-mtp quantize          the ingredients of one node's cache key
  buildkit graph xl-mtp --format mermaid    the step DAG
  buildkit gc                               free what no built variant still uses

The store defaults to ./cache (override with --store or BUILDKIT_STORE).
"""


def _store_root(args) -> Path:
    return Path(args.store or os.environ.get("BUILDKIT_STORE") or "cache").absolute()


def _store(args):
    from .store import Store

    return Store(_store_root(args))


def _manifest(args):
    from . import manifest

    return manifest.load(args.variant, args.manifests, source=getattr(args, "source", None))


def _scheduler(args):
    from .scheduler import Scheduler
    from .steps.base import BuildOptions

    opts = BuildOptions(
        project_root=Path.cwd(),
        out_dir=Path(args.out).absolute() if getattr(args, "out", None) else None,
        release=getattr(args, "release", False),
        push=getattr(args, "push", None),
        dry_run=getattr(args, "dry_run", False),
        rehash=getattr(args, "rehash", False),
    )
    return Scheduler(_manifest(args), _store(args), opts)


def _build_request(args) -> dict | None:
    """What a plain build's result depends on besides files (``uptodate.py``); None for a
    build that must plan (a target, a release, a push, a re-hash)."""
    if args.target or args.release or args.push or args.rehash:
        return None
    return {
        "variant": args.variant,
        "manifests": os.path.abspath(args.manifests),
        "source": args.source,
        "out": os.path.abspath(args.out) if args.out else None,
        "cwd": os.getcwd(),
        "python": [sys.prefix, sys.version],
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("BUILDKIT_", "HF_"))},
    }


def cmd_build(args) -> int:
    if args.release and args.target:
        raise UsageError("--release locks the whole variant; drop --target")
    started = time.time_ns()
    request = _build_request(args)
    if request is not None and not args.full_check and (rec := uptodate.check(_store_root(args), request)):
        if not args.quiet:
            for name, kind, key in rec["nodes"]:
                print(f"[cached] {name} ({kind}) {key}", file=sys.stderr)
            n = len(rec["nodes"])
            print(f"{rec['variant']}: {n} steps, 0 ran, {n} cached in {(time.time_ns() - started) / 1e9:.2f}s "
                  f"(up to date: {len(rec['files'])} files as the last build left them)", file=sys.stderr)
        return 0
    sched = _scheduler(args)
    states = sched.build(args.target or None, jobs=args.jobs, quiet=args.quiet)
    if request is not None:
        # Only a shortcut for the next build: this one is done, whatever happens to the record
        # (a store entry collected meanwhile, a full disk).
        with contextlib.suppress(OSError, BuildkitError):
            if (files := sched.watched(states)) is not None:
                report = {"variant": sched.m.name, "nodes": [[s.name, s.kind, keys.short(s.key)] for s in states]}
                uptodate.record(sched.store.root, request, *files, report, started)
    if args.release:
        from .release import write_lock

        path = write_lock(sched, states)
        print(f"wrote {path}", file=sys.stderr)
    if args.push:
        from .release import push

        push(sched, states, args.push, dry_run=args.dry_run)
    return 0


def cmd_plan(args) -> int:
    sched = _scheduler(args)
    states = sched.plan(args.target or None)
    for st in states:
        status = "fresh" if st.fresh else "stale"
        key = keys.short(st.key) if st.key else "?" * 12
        why = "" if st.fresh else ": " + "; ".join(st.reasons)
        print(f"{status:5} {st.name} ({st.kind}) {key}{why}")
    stale = sum(not s.fresh for s in states)
    print(f"{sched.m.name}: {len(states)} steps, {stale} to run")
    return 0


def cmd_explain(args) -> int:
    print(json.dumps(_scheduler(args).explain(args.node), indent=2, sort_keys=True, default=str))
    return 0


def cmd_graph(args) -> int:
    from . import graph as graphs

    print(graphs.render(graphs.build(_manifest(args)), args.format))
    return 0


def cmd_gc(args) -> int:
    r = _store(args).gc(dry_run=args.dry_run)
    verb = "would free" if args.dry_run else "freed"
    print(f"{verb} {r['bytes'] / 1e6:.1f} MB ({r['bytes']} bytes): {r['actions']} actions, {r['artifacts']} artifacts, {r['objects']} objects, {r['files']} records of deleted files")
    return 0


def cmd_store_check(args) -> int:
    bad = _store(args).check()
    for line in bad:
        print(line)
    print(f"{len(bad)} corrupt entries" + (" (removed; rebuild to restore)" if bad else ""))
    return 1 if bad else 0


def cmd_verify(args) -> int:
    from .release import verify_against

    return verify_against(args, _manifest(args))


def cmd_fixture(args) -> int:
    from .fixture import FixtureSpec, generate

    fields = {k: v for k, v in vars(args).items() if k in FixtureSpec.model_fields and v is not None}
    if args.trained:
        from .trained import write_trained

        if fields:
            raise UsageError(f"--trained has a fixed shape; drop --{' --'.join(sorted(fields)).replace('_', '-')}")
        try:
            print(write_trained(args.out))
        except FileExistsError as e:
            raise UsageError(str(e)) from None
        return 0
    try:
        spec = FixtureSpec(**fields)
    except ValueError as e:
        raise UsageError(f"bad fixture spec: {e}") from None
    try:
        path = generate(args.out, spec)
    except (FileExistsError, ValueError) as e:
        raise UsageError(str(e)) from None
    print(path)
    return 0


def cmd_list(args) -> int:
    from . import manifest

    for p in sorted(Path(args.manifests).glob("*.toml")):
        try:
            m = manifest.load(str(p), args.manifests)
            print(f"{m.name:16} {m.description}")
        except BuildkitError as e:
            print(f"{p.stem:16} (invalid: {e})")
    return 0


def parser(fixture_options: bool = True) -> argparse.ArgumentParser:
    """``fixture_options=False`` leaves out the ``fixture`` command's options, which come from
    FixtureSpec (pydantic): a build with nothing to do imports neither."""
    p = argparse.ArgumentParser(
        prog="buildkit",
        description="Declarative, content-addressed builds of quantized MLX model variants.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--store", help="store directory (default: $BUILDKIT_STORE or ./cache)")
    p.add_argument("--manifests", default="manifests", help="directory of variant manifests (default: manifests)")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def variant_cmd(name, fn, help_):
        s = sub.add_parser(name, help=help_, description=help_)
        s.add_argument("variant", help="a manifest name in --manifests (e.g. xl-mtp) or a path to a .toml")
        s.add_argument("--source", help="replace the manifest's source: a directory, hf://org/repo@revision or fixture:...")
        s.set_defaults(fn=fn)
        return s

    b = variant_cmd("build", cmd_build, "Build a variant: run the stale steps, reuse the rest from the store.")
    b.add_argument("--out", help="directory publish writes to (default: the manifest's, out/VARIANT)")
    b.add_argument("-j", "--jobs", type=int, default=2, help="steps run in parallel (default 2)")
    b.add_argument("--target", action="append", help="build only this step and what it needs (repeatable)")
    b.add_argument("--release", action="store_true", help="require a pinned source revision and write manifests/VARIANT.lock")
    b.add_argument("--push", metavar="ORG/NAME", help="upload the published directory with huggingface_hub")
    b.add_argument("--dry-run", action="store_true", help="with --push: list the upload operations instead")
    b.add_argument("--rehash", action="store_true", help="re-hash source files instead of trusting the stat cache")
    b.add_argument(
        "--full-check", action="store_true",
        help="decide every step by its key even if no file it depends on changed since the last successful build",
    )
    b.add_argument("-q", "--quiet", action="store_true", help="no progress output")

    pl = variant_cmd("plan", cmd_plan, "Show every step as fresh or stale, with the reason.")
    pl.add_argument("--target", action="append", help="plan only this step and what it needs")
    pl.add_argument("--rehash", action="store_true", help="re-hash source files")

    e = variant_cmd("explain", cmd_explain, "Show the ingredients of one step's cache key and why it is stale.")
    e.add_argument("node", help="step name in the manifest")

    g = variant_cmd("graph", cmd_graph, "Print the step DAG.")
    g.add_argument("--format", choices=["text", "dot", "mermaid"], default="text")

    v = variant_cmd("verify", cmd_verify, "Rebuild in an empty store and compare with a release lock, digest by digest.")
    v.add_argument("--against", required=True, help="lock file (e.g. manifests/xl.lock)")
    v.add_argument("-j", "--jobs", type=int, default=2)

    gc = sub.add_parser("gc", help="Remove store entries no built variant reaches.", description="Remove actions no ref names, then artifacts and objects no kept action reaches, and forget the hashes of files that no longer exist; says how much it freed.")
    gc.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    gc.set_defaults(fn=cmd_gc)

    st = sub.add_parser("store", help="Store maintenance.", description="Store maintenance.")
    st_sub = st.add_subparsers(dest="store_cmd", required=True, metavar="ACTION")
    chk = st_sub.add_parser("check", help="Re-hash every object; remove and report corrupt ones.")
    chk.set_defaults(fn=cmd_store_check)

    ls = sub.add_parser("list", help="List the variants in --manifests.")
    ls.set_defaults(fn=cmd_list)

    fx = sub.add_parser(
        "fixture",
        help="Write a small deterministic qwen3_5_moe checkpoint in Hugging Face layout.",
        description="Write a small deterministic qwen3_5_moe checkpoint (sharded bf16 safetensors + index, config.json, tokenizer, mtp.* in the last shard).",
    )
    fx.add_argument("out", help="directory to create (must not exist or be empty)")
    fx.add_argument(
        "--trained", action="store_true",
        help="write the small checkpoint trained on real text (buildkit/data/trained) instead of random weights",
    )
    if fixture_options:
        from .fixture import FixtureSpec

        for name, f in FixtureSpec.model_fields.items():
            fx.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, help=f"(default {f.default})")
    fx.set_defaults(fn=cmd_fixture)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser(fixture_options="fixture" in argv).parse_args(argv)
    allocator.tune()
    try:
        return args.fn(args)
    except BuildkitError as e:
        print(f"buildkit: error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # the disk or the OS said no (full, read-only, permissions)
        print(f"buildkit: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("buildkit: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The ``buildkit`` command: ``main``, then an exit that skips the interpreter's last
    collections. A build leaves hundreds of thousands of objects (listings, records, modules)
    for them to walk: after a cold xl build of the bench fixture, the process ended 0.27-0.36 s
    after the build's last line, 0.06-0.08 s frozen (three builds each). Nothing is skipped
    but that walk: atexit handlers and the flushing of open files run as before."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
