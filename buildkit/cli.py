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
  buildkit estimate xl --source DIR         size and bits per weight from headers alone
  buildkit compare xl xl-mtp oq4e-mtp-xl    eval figures side by side (--plot FILE.png)
  buildkit eval out/xl --source DIR         grade any MLX directory against a bf16 source
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


def _remote(args, env: bool = True):
    """The remote cache of ``--remote`` (else ``BUILDKIT_REMOTE`` if ``env``), or None."""
    url = getattr(args, "remote", None) or (os.environ.get("BUILDKIT_REMOTE") if env else None)
    if not url:
        if getattr(args, "remote_upload", False):
            raise UsageError(
                "--remote-upload needs a remote: pass --remote URL or set BUILDKIT_REMOTE"
            )
        return None
    from .remote import Remote

    return Remote.open(url, quiet=getattr(args, "quiet", False))


def _scheduler(args, remote=None):
    from .scheduler import Scheduler
    from .steps.base import BuildOptions

    opts = BuildOptions(
        project_root=Path.cwd(),
        out_dir=Path(args.out).absolute() if getattr(args, "out", None) else None,
        release=getattr(args, "release", False),
        push=getattr(args, "push", None),
        rehash=getattr(args, "rehash", False),
        dask=getattr(args, "dask", None) or None,
        remote=remote,
    )
    return Scheduler(_manifest(args), _store(args), opts)


def _build_request(args) -> dict | None:
    """What a plain build's result depends on besides files (``uptodate.py``); None for a
    build that must plan (a target, a release, a push, a re-hash)."""
    if args.target or args.release or args.push or args.rehash or args.remote_upload:
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
    if args.dry_run:  # like make -n: say what would run, run nothing
        code = cmd_plan(args)
        if args.push:
            print(f"then: upload the published directory to {args.push}")
        return code
    started = time.time_ns()
    request = _build_request(args)
    if (
        request is not None
        and not args.full_check
        and (rec := uptodate.check(_store_root(args), request))
    ):
        if not args.quiet:
            for name, kind, key in rec["nodes"]:
                print(f"[cached] {name} ({kind}) {key}", file=sys.stderr)
            n = len(rec["nodes"])
            print(
                f"{rec['variant']}: {n} steps, 0 ran, "
                f"{n} cached in {(time.time_ns() - started) / 1e9:.2f}s "
                f"(up to date: {len(rec['files'])} files as the last build left them)",
                file=sys.stderr,
            )
        return 0
    sched = _scheduler(args, remote := _remote(args))
    states = sched.build(args.target or None, jobs=args.jobs, quiet=args.quiet)
    if request is not None:
        # Only a shortcut for the next build: this one is done, whatever happens to the record
        # (a store entry collected meanwhile, a full disk).
        with contextlib.suppress(OSError, BuildkitError):
            if (files := sched.watched(states)) is not None:
                report = {
                    "variant": sched.m.name,
                    "nodes": [[s.name, s.kind, keys.short(s.key)] for s in states],
                }
                uptodate.record(sched.store.root, request, *files, report, started)
    if args.remote_upload:
        _print_sent(remote.push(sched.store, [(s.name, s.key, s.outputs) for s in states]), remote)
    if args.release:
        from .release import write_lock

        path = write_lock(sched, states)
        print(f"wrote {path}", file=sys.stderr)
    if args.push:
        from .release import push

        push(sched, states, args.push)
    return 0


def _plan_rows(sched, states) -> list[dict]:
    return [
        {
            "step": s.name,
            "kind": s.kind,
            "fresh": s.fresh,
            "key": s.key,
            "reasons": s.reasons,
            "waits_for": s.waits_for,
        }
        for s in states
    ]


def _print_sent(sent: dict, remote) -> None:
    print(
        f"remote: sent {sent['nodes']} nodes "
        f"({sent['objects']} objects, {sent['listings']} listings, "
        f"{sent['bytes']} bytes) to {remote.url}; {sent['skipped']} nodes already there",
        file=sys.stderr,
    )


def cmd_push(args) -> int:
    from .remote import push_variant

    remote = _remote(args)
    if remote is None:
        raise UsageError("push needs a remote: pass --remote URL or set BUILDKIT_REMOTE")
    _print_sent(push_variant(_scheduler(args), remote), remote)  # planned from the local store only
    return 0


def cmd_pull(args) -> int:
    from .remote import pull_variant

    remote = _remote(args)
    if remote is None:
        raise UsageError("pull needs a remote: pass --remote URL or set BUILDKIT_REMOTE")
    states = pull_variant(_scheduler(args, remote), remote)
    t = remote.be.traffic
    print(
        f"pulled {len(states)} nodes of {args.variant} from {remote.url}: "
        f"{t.bytes_down} bytes in {t.gets} downloads",
        file=sys.stderr,
    )
    return 0


def cmd_plan(args) -> int:
    sched = _scheduler(args, _remote(args))
    sched.check_request(args.target or None)
    states = sched.plan(args.target or None)
    rows = _plan_rows(sched, states)
    stale = sum(not s.fresh for s in states)
    if getattr(args, "json", False):
        print(
            json.dumps(
                {
                    "variant": sched.m.name,
                    "request": sched.request(),
                    "steps": rows,
                    "to_run": stale,
                },
                indent=2,
            )
        )
        return 0
    for r in rows:
        status = "fresh" if r["fresh"] else "stale"
        key = keys.short(r["key"]) if r["key"] else f"(key depends on {', '.join(r['waits_for'])})"
        why = "" if r["fresh"] else ": " + "; ".join(r["reasons"])
        print(f"{status:5} {r['step']} ({r['kind']}) {key}{why}")
    print(f"{sched.m.name}: {len(states)} steps, {stale} to run")
    return 0


def cmd_explain(args) -> int:
    sched = _scheduler(args, _remote(args))
    info = sched.explain(args.node)
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True, default=str))
        return 0
    node = sched.m.nodes[args.node]
    state = "fresh" if info["fresh"] else "stale: " + "; ".join(info["reasons"])
    print(f"{sched.m.name} / {args.node} ({info['kind']}): {state}")
    print(f"key: {info['key'] or '(not known until its inputs are built)'}")
    for slot, refs in info["inputs"].items():
        print(f"input {slot}: {', '.join(refs)}")
    rules = explain_rules(node.params)
    if rules:
        print(
            "rules, in the order they are tried "
            "(first match wins; a child manifest's before its parent's):"
        )
        for i, (pattern, role, spec) in enumerate(rules, 1):
            print(f"  {i:2}. {pattern!r:42} -> {role} ({spec})")
    if info["ingredients"]:
        print("ingredients of the key:")
        print(json.dumps(summarise(info["ingredients"]), indent=2, sort_keys=True, default=str))
    return 0


def explain_rules(params) -> list[tuple[str, str, str]]:
    """(pattern, role, what the role does) for a quantizing step's rules, in the order tried."""
    recipe = getattr(params, "recipe", None)
    if recipe is None:
        return []
    ordered = [*getattr(params, "rules", {}).items(), *recipe.rules.items()]
    out = []
    for pattern, role in ordered:
        r = recipe.roles[role]
        out.append(
            (
                pattern,
                role,
                "bf16 passthrough"
                if r.passthrough
                else f"{r.bits}-bit, group {r.group_size}{', calibrated' if r.calibrated else ''}",
            )
        )
    return out


def summarise(ingredients: dict) -> dict:
    """The ingredients with a resolved plan's tensor table counted, not listed (--json lists it)."""
    params = ingredients.get("params")
    plan = params.get("plan") if isinstance(params, dict) else None
    if not isinstance(plan, dict) or "tensors" not in plan:
        return ingredients
    counts: dict[str, int] = {}
    for role in plan["tensors"].values():
        counts[role] = counts.get(role, 0) + 1
    return {
        **ingredients,
        "params": {
            **params,
            "plan": {**plan, "tensors": f"{len(plan['tensors'])} tensors: {counts}"},
        },
    }


def cmd_graph(args) -> int:
    from . import graph as graphs

    print(graphs.render(graphs.build(_manifest(args)), args.format))
    return 0


def cmd_gc(args) -> int:
    store = _store(args)
    r = store.gc(dry_run=args.dry_run, keep_last=args.keep_last)
    verb = "would free" if args.dry_run else "freed"
    for root in r["roots"]:
        req = root["request"]
        print(
            f"{'would forget' if args.dry_run else 'forgot'} build {req.get('variant')} "
            f"(source {req.get('source')}, out {req.get('out') or 'default'})"
        )
    if args.dry_run:
        for variant, nodes in sorted(r["nodes"].items()):
            print(f"{variant}:")
            for node, ks in sorted(nodes.items()):
                print(
                    f"  {node}: {len(ks)} action(s) "
                    f"{', '.join(ks[:4])}{' ...' if len(ks) > 4 else ''}"
                )
    print(
        f"{verb} {r['bytes'] / 1e6:.1f} MB ({r['bytes']} bytes): "
        f"{r['actions']} actions, {r['artifacts']} artifacts, "
        f"{r['objects']} objects, {r['memos']} memos, {r['files']} records of deleted files"
    )
    remote = _remote(args, env=False)  # only an explicit --remote: never BUILDKIT_REMOTE alone
    if remote is not None:
        rr = remote.gc(args.dry_run, args.remote_max_age)
        print(
            f"remote {remote.url}: {verb} {rr['actions']} records, "
            f"{rr['artifacts']} listings, {rr['objects']} objects"
        )
    return 0


def cmd_forget(args) -> int:
    out = os.path.abspath(args.out) if args.out else None
    dropped = _store(args).forget(args.variant, out=out)
    for root in dropped:
        req = root["request"]
        print(
            f"forgot build {req.get('variant')} "
            f"(source {req.get('source')}, out {req.get('out') or 'default'})"
        )
    if not dropped:
        print(f"no build of {args.variant}{f' published to {out}' if out else ''} is remembered")
        return 1
    print("run `buildkit gc` to free what no remembered build uses")
    return 0


def cmd_status(args) -> int:
    from . import grades, manifest
    from .plan import Planner
    from .steps.base import BuildOptions

    store = _store(args)
    remote = _remote(args)
    last: dict[str, dict] = {}
    for root in store.roots():  # oldest first: the last one wins
        last[root["request"].get("variant")] = root
    rows = []
    for p in sorted(Path(args.manifests).glob("*.toml")):
        row = {"variant": p.stem, "built": False}
        root = last.get(p.stem)
        try:
            if root is None:
                m = manifest.load(str(p), args.manifests)
                row.update(state="never built", reason="never built")
            else:
                req = root["request"]
                m = manifest.load(str(p), args.manifests, source=req.get("source"))
                out = Path(req["out"]) if req.get("out") else None
                planner = Planner(
                    m, store, BuildOptions(project_root=Path.cwd(), out_dir=out, remote=remote)
                )
                states = planner.plan()
                stale = [s for s in states if not s.fresh]
                row.update(
                    built=True,
                    source=req.get("source"),
                    out=req.get("out"),
                    when=time.strftime(
                        "%Y-%m-%d %H:%M:%S", time.localtime(root.get("built_ns", 0) / 1e9)
                    ),
                    state="stale" if stale else "fresh",
                    reason=f"{stale[0].name}: {stale[0].reasons[0]}" if stale else "",
                )
                figures = grades.last_results(store, p.stem)
                if figures:
                    row["eval"] = {
                        k: figures[0].get(k) for k, _, _ in grades.COLUMNS if k in figures[0]
                    }
                    if figures[0].get("domains"):
                        row["eval"]["domains"] = figures[0]["domains"]
        except BuildkitError as e:
            row.update(state="invalid", reason=str(e).splitlines()[0])
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        where = (
            f"  source {r['source']}, out {r.get('out') or 'default'}, built {r['when']}"
            if r["built"]
            else ""
        )
        print(
            f"{r['variant']:16} {r['state']:11}{where}"
            + (f"\n{'':16} {r['reason']}" if r["reason"] and r["state"] != "never built" else "")
        )
        if r.get("eval"):
            e = r["eval"]
            print(
                f"{'':16} "
                + ", ".join(f"{h} {f(e[k])}" for k, h, f in grades.COLUMNS if e.get(k) is not None)
            )
            for name, d in sorted((e.get("domains") or {}).items()):
                print(f"{'':18}{grades.domain_line(name, d)}")
    return 0


def cmd_eval(args) -> int:
    from . import calibration as cal
    from . import evaluate as ev
    from .steps.eval import EvalParams, heldout_tokens, read_text, whole_tokens

    p = EvalParams()
    model, source = ev.DirWeights(Path(args.model)), ev.DirWeights(Path(args.source))
    if source.quantization:
        raise UsageError(
            f"--source {args.source} is quantized; point it at the bf16 source directory"
        )
    limit = args.max_tokens or p.max_tokens
    if args.text:  # the user's own text: graded whole
        text = read_text(cal.text_path(args.text, Path.cwd()))
        tokens, in_text = whole_tokens(text, source.tokenizer_json(), limit)
        graded = {"text": args.text, "text_tokens": in_text, "lines": "all"}
    else:  # the builtin calibration text: its held-out lines, as the eval step grades it
        text = read_text(cal.text_path(p.text, Path.cwd()))
        tokens = heldout_tokens(text, p.heldout_every, source.tokenizer_json(), limit)
        graded = {"text": p.text, "lines": f"held-out (every {p.heldout_every}th)"}
    figures, _ = ev.evaluate(source, model, tokens, p.seq_len)
    figures |= graded
    figures["size_bytes"] = model.bytes()
    if args.json:
        print(json.dumps(figures, indent=2, sort_keys=True))
        return 0
    for k, v in figures.items():
        print(f"{k:20} {v:.6g}" if isinstance(v, float) else f"{k:20} {v}")
    return 0


def cmd_compare(args) -> int:
    from . import grades

    store = _store(args)
    rows, missing = [], []
    for v in args.variants:
        got = grades.last_results(store, Path(v).stem)
        rows += got
        if not got:
            missing.append(v)
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
    elif rows:
        print(grades.table(rows))
    for v in missing:
        print(
            f"{v}: no eval results (never built, or its last build has no eval step)",
            file=sys.stderr,
        )
    if args.plot and rows:
        grades.plot(rows, Path(args.plot))
        print(f"wrote {args.plot}", file=sys.stderr)
    return 1 if missing else 0


def cmd_store_check(args) -> int:
    bad = _store(args).check()
    for line in bad:
        print(line)
    print(f"{len(bad)} corrupt entries" + (" (removed; rebuild to restore)" if bad else ""))
    return 1 if bad else 0


def cmd_verify(args) -> int:
    from .release import verify_against

    return verify_against(_manifest(args), args.against, args.jobs, remote=_remote(args))


def cmd_fixture(args) -> int:
    from .fixture import PRESETS, FixtureSpec, generate

    fields = {
        k: v for k, v in vars(args).items() if k in FixtureSpec.model_fields and v is not None
    }
    if args.trained:
        from .trained import write_trained

        if fields or args.preset or args.sparse:
            given = [
                *sorted(fields),
                *(["preset"] if args.preset else []),
                *(["sparse"] if args.sparse else []),
            ]
            raise UsageError(
                f"--trained has a fixed shape; drop --{' --'.join(given).replace('_', '-')}"
            )
        try:
            print(write_trained(args.out))
        except FileExistsError as e:
            raise UsageError(str(e)) from None
        return 0
    fields = (dict(PRESETS[args.preset]) if args.preset else {}) | fields
    try:
        spec = FixtureSpec(**fields)
    except ValueError as e:
        raise UsageError(f"bad fixture spec: {e}") from None
    try:
        path = generate(args.out, spec, sparse=args.sparse)
    except (FileExistsError, ValueError) as e:
        raise UsageError(str(e)) from None
    print(path)
    return 0


def cmd_estimate(args) -> int:
    from .estimate import estimate, render

    e = estimate(_manifest(args))
    print(json.dumps(e, indent=2) if args.json else render(e))
    return 0


def cmd_list(args) -> int:
    from . import manifest

    rows = []
    for p in sorted(Path(args.manifests).glob("*.toml")):
        try:
            m = manifest.load(str(p), args.manifests)
            inherited = (
                f" (description inherited from {m.description_from})"
                if m.description_from != m.name
                else ""
            )
            rows.append(
                {
                    "variant": m.name,
                    "description": m.description,
                    "description_from": m.description_from,
                    "line": f"{m.name:16} {m.description}{inherited}",
                }
            )
        except BuildkitError as e:
            rows.append({"variant": p.stem, "error": str(e), "line": f"{p.stem:16} (invalid: {e})"})
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "line"} for r in rows], indent=2))
    else:
        print("\n".join(r["line"] for r in rows))
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
    p.add_argument(
        "--manifests",
        default="manifests",
        help="directory of variant manifests (default: manifests)",
    )
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def variant_cmd(name, fn, help_):
        s = sub.add_parser(name, help=help_, description=help_)
        s.add_argument(
            "variant", help="a manifest name in --manifests (e.g. xl-mtp) or a path to a .toml"
        )
        s.add_argument(
            "--source",
            help="replace the manifest's source: a directory, "
            "hf://org/repo@revision or fixture:...",
        )
        s.set_defaults(fn=fn)
        return s

    def remote_flag(s):
        s.add_argument(
            "--remote",
            metavar="URL",
            help="remote cache asked on a local miss: s3://bucket/prefix or file:///dir "
            "(default $BUILDKIT_REMOTE)",
        )

    def request_flags(s):
        """The flags that change what a build makes or where: build and plan take the same."""
        remote_flag(s)
        s.add_argument(
            "--out", help="directory publish writes to (default: the manifest's, out/VARIANT)"
        )
        s.add_argument(
            "--target", action="append", help="only this step and what it needs (repeatable)"
        )
        s.add_argument(
            "--release",
            action="store_true",
            help="require a pinned source revision; build also writes manifests/VARIANT.lock",
        )
        s.add_argument(
            "--rehash",
            action="store_true",
            help="re-hash source files instead of trusting the stat cache",
        )

    b = variant_cmd(
        "build", cmd_build, "Build a variant: run the stale steps, reuse the rest from the store."
    )
    request_flags(b)
    b.add_argument("-j", "--jobs", type=int, default=2, help="steps run in parallel (default 2)")
    b.add_argument(
        "--push", metavar="ORG/NAME", help="upload the published directory with huggingface_hub"
    )
    b.add_argument(
        "--dry-run",
        action="store_true",
        help="plan only: print what would run and why, run nothing (like make -n)",
    )
    b.add_argument(
        "--full-check",
        action="store_true",
        help="decide every step by its key even if no file it depends on changed "
        "since the last successful build",
    )
    b.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    b.add_argument(
        "--dask",
        metavar="ADDRESS",
        default=os.environ.get("BUILDKIT_DASK"),
        help="run the per-tensor work on a Dask cluster: a scheduler (tcp://host:8786) or "
        "local:N (start N worker processes); every worker must see the store at the same "
        "path (default: $BUILDKIT_DASK, else local threads)",
    )
    b.add_argument(
        "--remote-upload",
        action="store_true",
        help="after the build, upload every node the remote lacks "
        "(objects, listings, then the record; signed with $BUILDKIT_SIGNING_KEY if set)",
    )
    b.add_argument("--json", action="store_true", help="with --dry-run: the plan as JSON")

    pl = variant_cmd(
        "plan", cmd_plan, "Show every step as fresh or stale, with the reason; takes build's flags."
    )
    request_flags(pl)
    pl.add_argument("--json", action="store_true", help="machine-readable output")

    e = variant_cmd(
        "explain",
        cmd_explain,
        "Show one step's cache key, why it is stale, its rules in the order tried, "
        "and its key's ingredients.",
    )
    e.add_argument("node", help="step name in the manifest")
    e.add_argument("--out", help="as build's --out")
    e.add_argument(
        "--json", action="store_true", help="everything as JSON (the full resolved plan included)"
    )
    remote_flag(e)

    g = variant_cmd("graph", cmd_graph, "Print the step DAG.")
    g.add_argument(
        "--format",
        choices=["text", "dot", "mermaid"],
        default="text",
        help="text (one line per step), dot (Graphviz) or mermaid (default text)",
    )

    v = variant_cmd(
        "verify",
        cmd_verify,
        "Rebuild in an empty store and compare with a release lock, digest by digest.",
    )
    v.add_argument("--against", required=True, help="lock file (e.g. manifests/xl.lock)")
    v.add_argument("-j", "--jobs", type=int, default=2, help="steps run in parallel (default 2)")
    remote_flag(v)

    es = variant_cmd(
        "estimate",
        cmd_estimate,
        "Estimate a variant's size and bits per weight "
        "from config.json and the safetensors headers.",
    )
    es.formatter_class = argparse.RawDescriptionHelpFormatter
    es.epilog = """\
Reads no tensor data: roles are assigned exactly as quantize assigns them, to the names
sanitize (and graft, for an MTP head) would produce. A directory source reads its shard
headers; hf://org/repo@rev reads config.json and the headers through huggingface_hub's
safetensors-metadata API (range reads, no weights downloaded); fixture:... uses the
generator's plan. Bytes are the published tensors' payload; bits per weight are bytes x 8
over source parameters, with the vision tower (as mlx_vlm counts) and text only (as mlx_lm
counts); an MTP head is reported on its own.

examples:
  buildkit estimate xl
  buildkit estimate xl-mtp --source hf://Qwen/Qwen3.6-35B-A3B@<sha> --json
"""
    es.add_argument(
        "--json",
        action="store_true",
        help="print JSON: bits_per_weight, bits_per_weight_text, bytes, parts, roles",
    )

    for name, fn, help_ in (
        (
            "push",
            cmd_push,
            "Upload a built variant's closure "
            "(every node's record, listings and objects) to the remote.",
        ),
        (
            "pull",
            cmd_pull,
            "Download a variant's closure from the remote into the local store (views into source "
            "files are not objects: the source must be here).",
        ),
    ):
        pp = variant_cmd(name, fn, help_)
        request_flags(pp)
        pp.add_argument("-q", "--quiet", action="store_true", help="no progress output")

    gc = sub.add_parser(
        "gc",
        help="Free store entries no remembered build reaches.",
        description="Every build request (variant, source, out) is remembered until forgotten "
        "(`forget`, or --keep-last). gc removes the actions no remembered build names, "
        "then the artifacts and objects no kept action reaches, the memos "
        "(load checks, shard links: redone on demand) and the records of "
        "source files that no longer exist, and says how much it freed.",
    )
    gc.add_argument(
        "--dry-run", action="store_true", help="list what would be removed, by variant and step"
    )
    gc.add_argument(
        "--keep-last",
        type=int,
        metavar="N",
        help="first forget all but the N newest builds of each variant",
    )
    gc.add_argument(
        "--remote",
        metavar="URL",
        help="also clean this remote cache (never $BUILDKIT_REMOTE alone): "
        "listings and objects no remote record names, older than a day; "
        "records too with --remote-max-age",
    )
    gc.add_argument(
        "--remote-max-age",
        type=float,
        metavar="DAYS",
        help="with --remote: first remove remote records older than DAYS "
        "(readers rebuild and re-upload)",
    )
    gc.set_defaults(fn=cmd_gc)

    fg = sub.add_parser(
        "forget",
        help="Forget a variant's builds, so gc may free them.",
        description="Forget the remembered builds of VARIANT (only those published to --out, if "
        "given); the next gc frees what no remembered build uses.",
    )
    fg.add_argument("variant", help="variant name")
    fg.add_argument(
        "--out", help="only the build that published to this directory (default out/VARIANT)"
    )
    fg.set_defaults(fn=cmd_forget)

    ev = sub.add_parser(
        "eval",
        help="Grade any MLX model directory against a bf16 source directory "
        "(KLD, top-1, perplexity, MTP acceptance).",
        description="The eval step's measurement for any MLX directory "
        "(buildkit's or mlx_lm.convert's) against a bf16 source in Hugging Face layout, "
        "each read one decoder layer at a time from its safetensors files.",
    )
    ev.add_argument("model", help="MLX model directory")
    ev.add_argument("--source", required=True, help="bf16 source directory (Hugging Face layout)")
    ev.add_argument(
        "--text",
        help="a UTF-8 text file, graded whole (default: the held-out lines, every 5th, of the "
        "builtin calibration text)",
    )
    ev.add_argument("--max-tokens", type=int, help="at most this many tokens (default 1024)")
    ev.add_argument("--json", action="store_true", help="machine-readable output")
    ev.set_defaults(fn=cmd_eval)

    cp = sub.add_parser(
        "compare",
        help="Variants' eval figures side by side, from their last builds.",
        description="Size, bits per weight, KL divergence (mean, p99), top-1 agreement, "
        "perplexity and MTP acceptance of each variant's last build, "
        "with labelled comparisons (a baseline) as rows.",
    )
    cp.add_argument("variants", nargs="+", metavar="VARIANT", help="variant names")
    cp.add_argument(
        "--plot", metavar="FILE.png", help="also draw size against KL divergence (needs matplotlib)"
    )
    cp.add_argument("--json", action="store_true", help="machine-readable output")
    cp.set_defaults(fn=cmd_compare)

    ss = sub.add_parser(
        "status",
        help="Every variant: its last build, fresh or stale, and why.",
        description="Every variant in --manifests with its last build (source, out, when), "
        "planned against the store: fresh, or stale with the first reason.",
    )
    ss.add_argument("--json", action="store_true", help="machine-readable output")
    remote_flag(ss)
    ss.set_defaults(fn=cmd_status)

    st = sub.add_parser("store", help="Store maintenance.", description="Store maintenance.")
    st_sub = st.add_subparsers(dest="store_cmd", required=True, metavar="ACTION")
    chk = st_sub.add_parser("check", help="Re-hash every object; remove and report corrupt ones.")
    chk.set_defaults(fn=cmd_store_check)

    ls = sub.add_parser(
        "list",
        help="List the variants in --manifests.",
        description="Each variant in --manifests with its description "
        "(an inherited one says from where).",
    )
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(fn=cmd_list)

    fx = sub.add_parser(
        "fixture",
        help="Write a small deterministic qwen3_5_moe checkpoint in Hugging Face layout.",
        description="Write a small deterministic qwen3_5_moe checkpoint "
        "(sharded bf16 safetensors + index, config.json, tokenizer, "
        "mtp.* in the last shard).",
    )
    fx.add_argument("out", help="directory to create (must not exist or be empty)")
    fx.add_argument(
        "--sparse",
        action="store_true",
        help="write tensors over 1 MiB as their first 4 KiB and a hole: real shapes, little disk",
    )
    fx.add_argument(
        "--trained",
        action="store_true",
        help="write the small checkpoint trained on real text (buildkit/data/trained) "
        "instead of random weights",
    )
    if fixture_options:
        from .fixture import PRESETS, FixtureSpec

        fx.add_argument(
            "--preset",
            choices=sorted(PRESETS),
            help="start from a real model's dimensions (qwen3.6-35b-a3b: ~72 GB; use --sparse); "
            "options given override it",
        )

        for name, f in FixtureSpec.model_fields.items():
            fx.add_argument(
                f"--{name.replace('_', '-')}", dest=name, type=int, help=f"(default {f.default})"
            )
    fx.set_defaults(fn=cmd_fixture)
    return p


def main(argv: list[str] | None = None) -> int:
    # numpy's OpenBLAS on one thread (before numpy loads; a user's setting stands): steps and
    # tensors already run on two threads, and its spinning threads on a busy 2-core machine
    # made calibrate's and verify's small matmuls 10-25x slower (bench/RESULTS.md "oq4e speed")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
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
    collections, a walk over the many objects a build leaves (bench/RESULTS.md); atexit
    handlers and the flushing of open files run as before."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
