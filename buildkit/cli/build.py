"""build, plan, explain, graph: what a variant's build does, has done and would do."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

from buildkit.cli.common import (
    load_manifest,
    open_remote,
    print_sent,
    remote_flag,
    request_flags,
    scheduler,
    store_root,
    variant_cmd,
)
from buildkit.core import keys
from buildkit.core.errors import BuildkitError, UsageError
from buildkit.store import uptodate


def build_request(args) -> dict | None:
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
    request = build_request(args)
    if (
        request is not None
        and not args.full_check
        and (rec := uptodate.check(store_root(args), request))
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
    sched = scheduler(args, remote := open_remote(args))
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
        print_sent(remote.push(sched.store, [(s.name, s.key, s.outputs) for s in states]), remote)
    if args.release:
        from buildkit.engine.release import check_gates, write_lock

        check_gates(sched, states)
        path = write_lock(sched, states)
        print(f"wrote {path}", file=sys.stderr)
    if args.push:
        from buildkit.engine.release import push

        push(sched, states, args.push)
    return 0


def plan_rows(sched, states) -> list[dict]:
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


def cmd_plan(args) -> int:
    sched = scheduler(args, open_remote(args))
    sched.check_request(args.target or None)
    states = sched.plan(args.target or None)
    rows = plan_rows(sched, states)
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
    sched = scheduler(args, open_remote(args))
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
    from buildkit.engine import graph as graphs

    print(graphs.render(graphs.build(load_manifest(args)), args.format))
    return 0


def add_build(sub) -> None:
    """``buildkit build``: its flags are the most of any command."""
    b = variant_cmd(
        sub,
        "build",
        cmd_build,
        "Build a variant: run the stale steps, reuse the rest from the store.",
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


def add(sub) -> None:
    """Register build, plan, explain and graph."""
    add_build(sub)
    pl = variant_cmd(
        sub,
        "plan",
        cmd_plan,
        "Show every step as fresh or stale, with the reason; takes build's flags.",
    )
    request_flags(pl)
    pl.add_argument("--json", action="store_true", help="machine-readable output")

    e = variant_cmd(
        sub,
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

    g = variant_cmd(sub, "graph", cmd_graph, "Print the step DAG.")
    g.add_argument(
        "--format",
        choices=["text", "dot", "mermaid"],
        default="text",
        help="text (one line per step), dot (Graphviz) or mermaid (default text)",
    )
