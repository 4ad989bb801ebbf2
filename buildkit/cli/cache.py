"""push, pull, gc, forget, store check: sharing the store and freeing it."""

from __future__ import annotations

import os
import sys

from buildkit.cli.common import (
    open_remote,
    open_store,
    print_sent,
    request_flags,
    scheduler,
    variant_cmd,
)
from buildkit.core.errors import UsageError


def cmd_push(args) -> int:
    from buildkit.store.remote import push_variant

    remote = open_remote(args)
    if remote is None:
        raise UsageError("push needs a remote: pass --remote URL or set BUILDKIT_REMOTE")
    print_sent(push_variant(scheduler(args), remote), remote)  # planned from the local store only
    return 0


def cmd_pull(args) -> int:
    from buildkit.store.remote import pull_variant

    remote = open_remote(args)
    if remote is None:
        raise UsageError("pull needs a remote: pass --remote URL or set BUILDKIT_REMOTE")
    states = pull_variant(scheduler(args, remote), remote)
    t = remote.be.traffic
    print(
        f"pulled {len(states)} nodes of {args.variant} from {remote.url}: "
        f"{t.bytes_down} bytes in {t.gets} downloads",
        file=sys.stderr,
    )
    return 0


def cmd_gc(args) -> int:
    store = open_store(args)
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
    remote = open_remote(args, env=False)  # only an explicit --remote: never BUILDKIT_REMOTE alone
    if remote is not None:
        rr = remote.gc(args.dry_run, args.remote_max_age)
        print(
            f"remote {remote.url}: {verb} {rr['actions']} records, "
            f"{rr['artifacts']} listings, {rr['objects']} objects"
        )
    return 0


def cmd_forget(args) -> int:
    out = os.path.abspath(args.out) if args.out else None
    dropped = open_store(args).forget(args.variant, out=out)
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


def cmd_store_check(args) -> int:
    bad = open_store(args).check()
    for line in bad:
        print(line)
    print(f"{len(bad)} corrupt entries" + (" (removed; rebuild to restore)" if bad else ""))
    return 1 if bad else 0


def add_gc(sub) -> None:
    """gc and forget: what the store keeps."""
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


def add(sub) -> None:
    """Register push, pull, gc, forget and store check."""
    add_gc(sub)
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
        pp = variant_cmd(sub, name, fn, help_)
        request_flags(pp)
        pp.add_argument("-q", "--quiet", action="store_true", help="no progress output")

    st = sub.add_parser("store", help="Store maintenance.", description="Store maintenance.")
    st_sub = st.add_subparsers(dest="store_cmd", required=True, metavar="ACTION")
    chk = st_sub.add_parser("check", help="Re-hash every object; remove and report corrupt ones.")
    chk.set_defaults(fn=cmd_store_check)
