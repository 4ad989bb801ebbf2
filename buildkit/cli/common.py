"""What every command group shares: the store, the manifest, the remote, a scheduler,
and the flags that choose them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from buildkit.core.errors import UsageError


def store_root(args) -> Path:
    return Path(args.store or os.environ.get("BUILDKIT_STORE") or "cache").absolute()


def open_store(args):
    from buildkit.store.store import Store

    return Store(store_root(args))


def load_manifest(args):
    from buildkit.engine import manifest

    return manifest.load(args.variant, args.manifests, source=getattr(args, "source", None))


def open_remote(args, env: bool = True):
    """The remote cache of ``--remote`` (else ``BUILDKIT_REMOTE`` if ``env``), or None."""
    url = getattr(args, "remote", None) or (os.environ.get("BUILDKIT_REMOTE") if env else None)
    if not url:
        if getattr(args, "remote_upload", False):
            raise UsageError(
                "--remote-upload needs a remote: pass --remote URL or set BUILDKIT_REMOTE"
            )
        return None
    from buildkit.store.remote import Remote

    return Remote.open(url, quiet=getattr(args, "quiet", False))


def scheduler(args, remote=None):
    from buildkit.engine.scheduler import Scheduler
    from buildkit.engine.step import BuildOptions

    opts = BuildOptions(
        project_root=Path.cwd(),
        out_dir=Path(args.out).absolute() if getattr(args, "out", None) else None,
        release=getattr(args, "release", False),
        push=getattr(args, "push", None),
        rehash=getattr(args, "rehash", False),
        dask=getattr(args, "dask", None) or None,
        remote=remote,
    )
    return Scheduler(load_manifest(args), open_store(args), opts)


def print_sent(sent: dict, remote) -> None:
    print(
        f"remote: sent {sent['nodes']} nodes "
        f"({sent['objects']} objects, {sent['listings']} listings, "
        f"{sent['bytes']} bytes) to {remote.url}; {sent['skipped']} nodes already there",
        file=sys.stderr,
    )


def variant_cmd(sub, name, fn, help_):
    """A subcommand that takes a variant and --source."""
    s = sub.add_parser(name, help=help_, description=help_)
    s.add_argument(
        "variant", help="a manifest name in --manifests (e.g. xl-mtp) or a path to a .toml"
    )
    s.add_argument(
        "--source",
        help="replace the manifest's source: a directory, hf://org/repo@revision or fixture:...",
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
