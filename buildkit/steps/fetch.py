"""fetch: resolve a source to local files and record their content digests.

Sources: a local directory; ``hf://org/repo@revision`` (huggingface_hub
``snapshot_download``, which honours HF_HUB_OFFLINE and the HF cache; every file checked
against the Hub's sha256 or git blob id by ``store.hub.verify_snapshot``); or
``fixture:`` / ``fixture:seed=1,layers=4`` (a deterministic generated
checkpoint, kept under the store); or ``fixture:trained`` / ``fixture:trained=NAME``
(a small trained checkpoint of ``buildkit.fixtures.trained``, also written under the
store). Safetensors shards stay where they are and are referenced by content digest;
small files (config, tokenizer) are copied into the store. Paths never enter the key, only
content digests do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import field_validator

from buildkit.core import keys
from buildkit.core.errors import SourceError, UsageError
from buildkit.engine.step import Context, Inherit, Params, WorldStep, register
from buildkit.fixtures.source import (
    HF_RE,
    PINNED,
    parse_fixture,
    source_kind,
    source_layout,
    trained_name,
)
from buildkit.store.artifact import Artifact

SMALL_FILE_LIMIT = 64 << 20
HF_PATTERNS = ["*.safetensors", "*.json", "*.txt", "*.model", "*.jinja", "*.py", "tokenizer*"]


class FetchParams(Params):
    source: Annotated[str, Inherit(top="source")]  # unset: the manifest's (or --source)

    @field_validator("source")
    @classmethod
    def _valid(cls, v: str) -> str:
        if v.startswith("hf://") and not HF_RE.match(v):
            raise ValueError(f"expected hf://org/repo@revision, got {v!r}")
        if source_kind(v) == "trained":
            trained_name(v)
        elif v.startswith("fixture:"):
            parse_fixture(v)
        return v

    def key_params(self, inputs=None) -> dict:
        """The source as it enters the key: what names it, never a path."""
        kind = source_kind(self.source)
        if kind == "hf":
            m = HF_RE.match(self.source)
            return {"type": "hf", "repo": m["repo"], "revision": m["rev"]}
        if kind == "fixture":
            return {"type": "fixture", "spec": parse_fixture(self.source).model_dump()}
        if kind == "trained":
            return {"type": "trained"}  # its identity is the content, as for a local directory
        return {"type": "local"}  # identity is the content, not the path


@register
class Fetch(WorldStep):
    kind = "fetch"
    version = 1
    Params = FetchParams
    outputs = ("out",)

    def estimate(self, params: FetchParams, inputs) -> dict[str, dict]:
        """The source's config and tensors (HF names) from its headers alone."""
        config, found = source_layout(params.source)
        tensors = {n: {"dtype": d, "shape": s} for n, (d, s) in found.items()}
        return {"out": {"config": config, "tensors": tensors}}

    def resolve(self, params: FetchParams, ctx: Context) -> tuple[Path, dict]:
        kind = source_kind(params.source)
        if kind == "hf":
            m = HF_RE.match(params.source)
            if ctx.options.release and not (m["rev"] and PINNED.match(m["rev"])):
                raise UsageError(
                    f"source {params.source!r}: a release build needs a pinned revision "
                    "(hf://org/repo@<40-hex commit sha>)"
                )
            from buildkit.store.hub import download

            rev = m["rev"] or "main"
            if not PINNED.match(rev):
                ctx.log(
                    f"warning: {params.source} is not pinned to a commit: this build is not "
                    "reproducible (the revision can move); pin it as hf://org/repo@<commit sha>"
                )
            path = download(m["repo"], rev, HF_PATTERNS, ctx.store, ctx.log)
            return path, {"type": "hf", "repo": m["repo"], "revision": path.name}
        if kind == "fixture":
            from buildkit.fixtures.generated import generate

            spec = parse_fixture(params.source)
            path = ctx.store.layout.fixtures / keys.short(
                keys.digest_json("fixture", spec.model_dump()), 16
            )
            if not (path / "config.json").exists():
                ctx.log(f"generating fixture checkpoint {params.source} in {path}")
                generate(path, spec)
            return path, {"type": "fixture", "spec": spec.model_dump()}
        if kind == "trained":
            from buildkit.fixtures.trained import data_digest, get, write_trained

            fixture = get(trained_name(params.source))
            path = ctx.store.root / "fixtures" / f"trained-{data_digest(fixture.data)}"
            if not (path / "config.json").exists():
                ctx.log(f"writing the trained fixture checkpoint in {path}")
                write_trained(path, fixture.data, spec=fixture.spec)
            return path, {"type": "trained"}  # its identity is its files, as for a directory
        path = Path(params.source).expanduser()
        if not path.is_absolute():
            path = ctx.options.project_root / path
        if not path.is_dir():  # the user named it: bad input, not a bad checkpoint (exit 2)
            raise UsageError(
                f"source {params.source!r}: no such directory ({path}); pass --source with a "
                "model directory, hf://org/repo@<sha> or fixture:seed=N"
            )
        return path, {"type": "local"}

    def _files(self, root: Path) -> list[Path]:
        files = sorted(
            p
            for p in root.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
        )
        if not any(p.suffix == ".safetensors" for p in files):
            raise SourceError(
                f"{root}: no *.safetensors files; is this a Hugging Face model directory?"
            )
        if not (root / "config.json").exists():
            raise SourceError(f"{root}: config.json is missing")
        return files

    @staticmethod
    def _digests(
        ctx: Context, root: Path, files: list[Path], rehash: bool = False
    ) -> dict[str, str]:
        """Content digest of each file, by its path relative to ``root``."""
        digests = ctx.store.sources.digest_files(files, rehash=rehash)
        return {str(p.relative_to(root)): d for p, d in zip(files, digests, strict=False)}

    def fingerprint(self, params: FetchParams, ctx: Context) -> dict:
        root, _ = self.resolve(params, ctx)
        return self._digests(ctx, root, self._files(root), rehash=ctx.options.rehash)

    def watch(self, params: FetchParams, ctx: Context) -> tuple[list[Path], list[Path]] | None:
        """The source's files and directories (their mtimes change when files come or go); a
        hub revision that is not a commit may move without any local file changing."""
        if source_kind(params.source) == "hf" and not PINNED.match(
            HF_RE.match(params.source)["rev"] or ""
        ):
            return None
        root, _ = self.resolve(params, ctx)
        files = self._files(root)
        dirs = {root, *(p.parent for p in files)}
        return sorted(dirs) + files, []

    def run(self, ctx: Context, params: FetchParams, inputs) -> dict[str, Artifact]:
        root, meta = self.resolve(params, ctx)
        art = Artifact(meta={"source": meta})
        files = self._files(root)
        digests = self._digests(ctx, root, files)
        if (
            ctx.fingerprint is not None and digests != ctx.fingerprint
        ):  # the key was made from those
            changed = self.describe_fingerprint_change(ctx.fingerprint, digests)
            raise SourceError(
                f"{root}: source files changed after this build hashed them ({changed}); run again"
            )
        ctx.progress.start(len(files), unit="files")
        for p in files:
            rel = str(p.relative_to(root))
            digest = digests[rel]
            if p.suffix == ".safetensors" or p.stat().st_size > SMALL_FILE_LIMIT:
                art.external[rel] = digest
            else:
                data = p.read_bytes()
                if keys.blob_digest(data) != digest:
                    raise SourceError(f"{p}: changed while it was being fetched; run again")
                art.files[rel] = ctx.store.put_blob(data)
            ctx.progress.advance(1, p.stat().st_size)
        return {"out": art}
