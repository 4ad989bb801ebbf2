"""The ``buildkit`` command line. Exit codes: 0 ok, 1 build failed, 2 bad usage or bad manifest."""

from __future__ import annotations

import argparse
import gc
import os
import sys

from buildkit.cli import build, cache, evaluation, models
from buildkit.core import allocator
from buildkit.core.errors import BuildkitError

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
    for group in (build, cache, evaluation):
        group.add(sub)
    models.add(sub, fixture_options)
    return p


def main(argv: list[str] | None = None) -> int:
    # numpy's OpenBLAS on one thread (before numpy loads; a user's setting stands): steps and
    # tensors already run on two threads, and its spinning threads on a busy 2-core machine
    # made calibrate's and verify's small matmuls many times slower (bench/RESULTS.md,
    # "numpy's BLAS on one thread")
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
    collections, a walk over the many objects a build leaves (bench/RESULTS.md, "Speed tricks
    re-measured"); atexit
    handlers and the flushing of open files run as before."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
