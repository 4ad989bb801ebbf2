"""fixture, estimate, list, verify: checkpoints to build from, sizes before building, the
variants, and release locks."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from buildkit.cli.common import (
    load_manifest,
    open_remote,
    remote_flag,
    variant_cmd,
)
from buildkit.core.errors import BuildkitError, SourceError, UsageError


def cmd_verify(args) -> int:
    from buildkit.engine.release import verify_against

    return verify_against(load_manifest(args), args.against, args.jobs, remote=open_remote(args))


def cmd_fixture(args) -> int:
    from buildkit.fixtures.generated import PRESETS, FixtureSpec, generate

    fields = {
        k: v for k, v in vars(args).items() if k in FixtureSpec.model_fields and v is not None
    }
    if args.trained:
        from buildkit.fixtures.trained import (
            DEFAULT,
            FIXTURES,
            REAL_ROWS_PER_INPUT,
            calibration_tokens,
            get,
            write_trained,
        )

        if args.out is None:  # `--trained OUT`: the default fixture, written to OUT
            if args.trained in FIXTURES:
                raise UsageError(f"--trained {args.trained} needs an output directory: OUT")
            args.trained, args.out = DEFAULT, args.trained
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
            fixture = get(args.trained)
            print(write_trained(args.out, fixture.data, spec=fixture.spec))
        except (FileExistsError, SourceError) as e:
            raise UsageError(str(e)) from None
        print(
            f"note: to calibrate with the real model's routed rows per expert input "
            f"({REAL_ROWS_PER_INPUT}), set the calibrate step's params.max_tokens = "
            f"{calibration_tokens(fixture.spec)}",
            file=sys.stderr,
        )
        return 0
    if args.out is None:
        raise UsageError("fixture needs an output directory: buildkit fixture OUT")
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
    from buildkit.engine.estimate import layouts
    from buildkit.quant.estimate import render, summary

    m = load_manifest(args)
    if not m.source:
        raise UsageError(f"{m.name}: no source; pass --source")
    e = summary(m.name, m.source, layouts(m))
    print(json.dumps(e, indent=2) if args.json else render(e))
    return 0


def cmd_list(args) -> int:
    from buildkit.engine import manifest

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


def add_fixture(sub, fixture_options: bool) -> None:
    """``fixture``: its size options come from FixtureSpec, imported only when asked for."""
    fx = sub.add_parser(
        "fixture",
        help="Write a small deterministic qwen3_5_moe checkpoint in Hugging Face layout.",
        description="Write a small deterministic qwen3_5_moe checkpoint "
        "(sharded bf16 safetensors + index, config.json, tokenizer, "
        "mtp.* in the last shard).",
    )
    fx.add_argument("out", nargs="?", help="directory to create (must not exist or be empty)")
    fx.add_argument(
        "--sparse",
        action="store_true",
        help="write tensors over 1 MiB as their first 4 KiB and a hole: real shapes, little disk",
    )
    fx.add_argument(
        "--trained",
        nargs="?",
        const="kjv",
        metavar="NAME",
        help="write a small checkpoint trained on real text instead of random weights: kjv "
        "(the default; buildkit/data/trained) or austen (shaped like the real model: 48 experts, "
        "top-4, experts 88%% of the weights; buildkit/data/trained-austen) or austen64 (64 "
        "experts, top-4, hidden 64; buildkit/data/trained-austen64). "
        "A build names it as --source fixture:trained or fixture:trained=NAME",
    )
    if fixture_options:
        from buildkit.fixtures.generated import PRESETS, FixtureSpec

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


def add(sub, fixture_options: bool = True) -> None:
    """Register verify, estimate, list and fixture."""
    add_fixture(sub, fixture_options)
    v = variant_cmd(
        sub,
        "verify",
        cmd_verify,
        "Rebuild in an empty store and compare with a release lock, digest by digest.",
    )
    v.add_argument("--against", required=True, help="lock file (e.g. manifests/xl.lock)")
    v.add_argument("-j", "--jobs", type=int, default=2, help="steps run in parallel (default 2)")
    remote_flag(v)

    es = variant_cmd(
        sub,
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

    ls = sub.add_parser(
        "list",
        help="List the variants in --manifests.",
        description="Each variant in --manifests with its description "
        "(an inherited one says from where).",
    )
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(fn=cmd_list)
