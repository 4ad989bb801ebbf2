"""publish: materialize an MLX model directory from artifacts, checked, then swapped in atomically.

Writes shards ``model-0000K-of-0000N.safetensors`` (metadata format=mlx) by
size, one part of the model (language model, MTP head, vision tower) at a time,
tensors sorted by name and streamed one at a time from the store;
``model.safetensors.index.json``; ``config.json`` with the ``quantization``
(and ``quantization_config``) defaults plus per-path overrides as mlx_lm reads
them; the tokenizer and other side files of the source; ``verify.json``; ``eval.json``
(the eval nodes' figures, also a table in the card); and a model card. The directory is built
beside the target, checked (index parity,
metadata, mlx_lm load with finite logits), then exchanged with the old one in
one rename, so a reader never sees a mix of old and new shards.

Shards are not written again when their bytes exist: quantizing steps write their tensors as
packs, store objects in the shape of the shards planned here (``packs.py``), and a shard that
is a pack is hard-linked from the store; a shard an earlier publish wrote (the same header and
store entries, in order) is linked from that file. Either is linked only while its stat shows
it unchanged (else it is hashed first). Since parts never share a shard, xl-mtp links xl's
shards and the head's pack; only the drafter directory's copy of the head is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import Field

from buildkit.clients import loadcheck
from buildkit.clients.configs import (
    drafter_config,
    missing_for_images,
)
from buildkit.core import keys
from buildkit.core.errors import StepError, UsageError
from buildkit.engine.step import Context, Params, SameBytes, Slot, WorldStep, register
from buildkit.formats import checkpoint as ckpt
from buildkit.formats.tensors import nbytes, read_header
from buildkit.present.card import model_card
from buildkit.present.tables import merge_evals
from buildkit.quant.quantize import quantization_config
from buildkit.store import packs
from buildkit.store.artifact import Artifact
from buildkit.store.fsio import DirectFile, drop_idle_write_buffers, file_ident, fsync_dir, settle
from buildkit.store.store import Store
from buildkit.store.swap import clear_leftovers, exchange, write_synced

STAMP = ".buildkit-publish.json"
COPY_CHUNK = 8 << 20
# What a model directory needs from its source beside config and weights: tokenizer, processor,
# chat template and generation config. Nothing else a source carries (a README.txt, a held-out
# text) is published; config.json, the index and the card are publish's own.
SIDE_FILES = frozenset(
    {
        "added_tokens.json",
        "chat_template.jinja",
        "chat_template.json",
        "generation_config.json",
        "merges.txt",
        "preprocessor_config.json",
        "processor_config.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
        "video_preprocessor_config.json",
        "vocab.json",
    }
)
HEAD_PREFIX, DRAFTER_DIR = ckpt.HEAD_PREFIX, ckpt.DRAFTER_DIR
DRAFTER_SHARD = f"{DRAFTER_DIR}/model.safetensors"


class PublishParams(Params):
    # where to write (``--out`` overrides)
    out: Annotated[str, SameBytes()] = "out/{variant}"
    max_shard_bytes: int = Field(default=5 << 30, ge=1 << 20)
    base_model: str | None = (
        None  # default: the hf:// source's repo; none for a fixture or a directory
    )
    description: str = ""
    tags: list[str] = Field(default_factory=lambda: ["mlx", "quantized", "qwen3_5_moe"])
    load_check: bool = True  # load the result with mlx_lm and check logits are finite


def out_dir(params: PublishParams, ctx: Context) -> Path:
    return ctx.out_path(params.out)


def copy_entry(store, entry: dict, sink, buf: bytearray) -> int:
    """A tensor's bytes to ``sink``: a store object through ``buf``; a view (a passthrough
    tensor as its source lies: the bf16 lm_head is 1 GB in the real model) in blocks of rows,
    so memory stays a block, not the tensor."""
    if "view" not in entry:
        return store.copy_tensor(entry, sink, buf)
    done = 0
    for block in store.iter_rows(entry, len(buf)):
        data = memoryview(block.reshape(-1).view("u1"))
        sink(data)
        done += len(data)
    return done


def merge_reports(reports: list[dict]) -> dict:
    """One report from several verify nodes; a scoped node's checks are named with their scope."""
    checks = {}
    for rep in reports:
        scope = rep.get("scope", "all")
        for name, r in rep.get("checks", {}).items():
            checks[name if scope == "all" else f"{name} ({scope})"] = r
    return {"ok": all(r["ok"] for r in checks.values()), "checks": checks}


@dataclass
class Staged:
    """A model written by ``Publish._stage`` into ``tmp``, checked, waiting to be swapped in."""

    dest: Path
    tmp: Path
    parts: list[Artifact]
    tensors: dict[str, dict]
    config: dict
    made: Path | None = None  # the outermost directory _stage created
    art: Artifact | None = None
    load_check: loadcheck.Lookup | None = None
    shards: dict[str, tuple[str, list[int]]] = field(default_factory=dict)  # name -> (digest, stat)
    linked: int = 0  # shards hard-linked (a pack, or an earlier publish's) rather than written
    source: dict = field(default_factory=dict)  # what fetch says the source was (for the card)


@register
class Publish(WorldStep):
    kind = "publish"
    version = 4  # 4: only the source's SIDE_FILES are copied (3: the drafter directory mtp/)
    Params = PublishParams
    inputs = {
        "model": Slot(many=True),
        "source": Slot(),
        "report": Slot(required=False, many=True),
        "eval": Slot(required=False, many=True),  # eval nodes: eval.json and the card's table
    }

    @property
    def writer(self) -> dict:
        return {self.kind: self.version}

    def destination(self, params: PublishParams, ctx: Context) -> Path:
        return out_dir(params, ctx)

    def check_request(self, params: PublishParams, ctx: Context) -> None:
        dest = out_dir(params, ctx)
        for d in [dest, *dest.parents]:
            if d.exists() and not d.is_dir():
                where = "it" if d == dest else f"{d}"
                raise UsageError(
                    f"Cannot publish to {dest}: {where} is a file, not a directory. "
                    "Pass --out with a directory path."
                )
        if dest.is_dir() and not (dest / STAMP).exists() and any(dest.iterdir()):
            raise UsageError(
                f"Cannot publish to {dest}: it exists and was not written by buildkit. "
                "Delete it or pass --out with a new path."
            )

    def outdated(
        self, params: PublishParams, outputs: dict[str, Artifact], ctx: Context
    ) -> str | None:
        out = out_dir(params, ctx)
        want = outputs["out"].digest
        try:
            stamp = json.loads((out / STAMP).read_text())
        except (OSError, ValueError):
            return f"output directory {out} is missing or was not written by buildkit"
        if stamp.get("artifact") != want:
            return f"output directory {out} holds another build"
        for name, size in outputs["out"].meta["sizes"].items():
            try:
                if (out / name).stat().st_size != size:
                    return f"{out / name} was modified"
            except FileNotFoundError:
                return f"{out / name} is missing"
        return None

    def watch(self, params: PublishParams, ctx: Context):
        out = out_dir(params, ctx)
        return [], [out, *sorted(out.rglob("*"))]

    def _stage(self, ctx: Context, params: PublishParams, inputs) -> Staged:
        """Everything but the verify reports: shards, index, config and side files in a temp
        directory beside the target, checked (index parity, mlx_lm load)."""
        store = ctx.store
        parts: list[Artifact] = inputs["model"]
        tensors: dict[str, dict] = {}
        for a in parts:
            for k, v in a.tensors.items():
                if k in tensors and tensors[k] != v:
                    raise StepError(
                        f"tensor {k!r} is produced by two model inputs with different bytes"
                    )
                tensors[k] = v
        src = inputs["source"][0]
        config = json.loads(store.get_blob(src.files["config.json"]))
        qcfg = quantization_config(parts)
        if qcfg:
            config["quantization"] = qcfg
            config["quantization_config"] = qcfg
        dest = out_dir(params, ctx)
        self.check_request(
            params, ctx
        )  # again: the directory may have changed since the build began
        made = next(
            (d for d in reversed(dest.parents) if not d.exists()), None
        )  # to undo on _discard
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        clear_leftovers(dest)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        staged = Staged(dest, tmp, parts, tensors, config, made, source=src.meta.get("source", {}))
        tok_cfg = (
            json.loads(store.get_blob(src.files["tokenizer_config.json"]))
            if "tokenizer_config.json" in src.files
            else {}
        )
        missing = missing_for_images(config, src.files, tok_cfg)
        if missing:
            ctx.log(
                f"warning: the source has a vision tower (vision_config) "
                f"but no {' and no '.join(missing)}: "
                "mlx_vlm loads the model but cannot run an image prompt; add them to the source"
            )
        try:
            if params.load_check:
                side = {k: v for k, v in src.files.items() if k in SIDE_FILES}
                staged.load_check = loadcheck.lookup(
                    store, config, tensors, self.writer, side, image=not missing
                )
                if staged.load_check.to_run:
                    loadcheck.warm(staged.load_check.to_run)  # while the shards are written
            staged.art = self._write(ctx, params, staged, src)
            drop_idle_write_buffers()  # all written; the load check, a build's memory peak, is next
            self._check(ctx, staged, params)
        except BaseException:
            self._discard(staged)
            raise
        return staged

    def _discard(self, prepared: Staged | None) -> None:
        if prepared is None:
            return
        shutil.rmtree(prepared.tmp, ignore_errors=True)
        if prepared.made is not None and not prepared.dest.exists():  # directories _stage created
            for d in [prepared.dest.parent, *prepared.dest.parent.parents]:
                if d == prepared.made.parent:
                    break
                with contextlib.suppress(OSError):
                    d.rmdir()  # only if empty

    def run(self, ctx: Context, params: PublishParams, inputs) -> dict[str, Artifact]:
        reports = (
            [merge_reports([r.meta.get("report", {}) for r in inputs.get("report", [])])]
            if inputs.get("report")
            else []
        )
        failed = [k for rep in reports for k, r in rep.get("checks", {}).items() if not r["ok"]]
        staged: Staged | None = None
        try:
            if failed:
                raise StepError(f"refusing to publish: verify failed {', '.join(failed)}")
            staged = self._stage(ctx, params, inputs)
            art, tmp, dest = staged.art, staged.tmp, staged.dest
            files = {}
            if reports:
                files["verify.json"] = json.dumps(reports[0], indent=2, sort_keys=True).encode()
            evals = merge_evals([e.meta.get("report", {}) for e in inputs.get("eval", [])])
            if evals:
                files["eval.json"] = json.dumps(evals, indent=2, sort_keys=True).encode()
            files["README.md"] = model_card(
                ctx.variant,
                params,
                staged.config.get("quantization"),
                staged.parts,
                reports,
                art.meta["bits_per_weight"],
                len(staged.tensors),
                staged.source,
                evals,
            ).encode()
            self._put_files(ctx.store, tmp, art, files)
            write_synced(
                tmp / STAMP, json.dumps({"artifact": art.digest, "variant": ctx.variant}).encode()
            )
            fsync_dir(tmp)
            with ctx.store.lock(
                keys.digest_json("publish", str(dest))
            ):  # one swap at a time per dir
                if dest.exists():
                    exchange(tmp, dest)
                else:
                    os.rename(tmp, dest)
                fsync_dir(dest.parent)
        finally:
            self._discard(staged)
        remember_shards(ctx.store, dest, staged.shards)
        linked = (
            f" ({staged.linked} of {len(staged.shards)} shards hard-linked, not written)"
            if staged.linked
            else ""
        )
        ctx.log(f"published {len(staged.tensors)} tensors to {dest}{linked}")
        return {"out": art}

    def _write(self, ctx, params, staged: Staged, src) -> Artifact:
        store, tmp, tensors, parts = ctx.store, staged.tmp, staged.tensors, staged.parts
        shards = packs.plan_shards(
            {k: (e["dtype"], e["shape"]) for k, e in tensors.items()}, params.max_shard_bytes
        )
        n = len(shards)
        weight_map, meta_shards, sizes = {}, {}, {}
        total = 0
        buf = bytearray(COPY_CHUNK)  # one buffer for every tensor: no fresh pages per tensor
        head = sorted(k for k in tensors if k.startswith(HEAD_PREFIX))
        ctx.progress.start(len(tensors) + len(head))
        for i, names in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{n:05d}.safetensors"
            weight_map.update(dict.fromkeys(names, fname))
            total += self._shard(ctx, staged, fname, [(k, tensors[k]) for k in names], buf)
        if head:  # the same store entries under the drafter's names: mlx_vlm's standalone layout
            (tmp / DRAFTER_DIR).mkdir()
            self._shard(
                ctx,
                staged,
                DRAFTER_SHARD,
                [(k.removeprefix(HEAD_PREFIX), tensors[k]) for k in head],
                buf,
            )
        for fname, (digest, ident) in staged.shards.items():
            meta_shards[fname], sizes[fname] = digest, ident[2]
        files: dict[str, bytes] = {
            "model.safetensors.index.json": json.dumps(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                indent=2,
            ).encode(),
            "config.json": json.dumps(staged.config, indent=2, sort_keys=True).encode(),
        }
        if head:
            files[f"{DRAFTER_DIR}/config.json"] = json.dumps(
                drafter_config(staged.config), indent=2, sort_keys=True
            ).encode()
        for name, digest in sorted(src.files.items()):
            if name in SIDE_FILES:
                files[name] = store.get_blob(digest)
        params_total = sum(
            r["params"] for a in parts for r in a.meta.get("role_table", {}).values()
        )
        bpw = sum(
            a.meta.get("bits_per_weight", 0)
            * sum(r["params"] for r in a.meta.get("role_table", {}).values())
            for a in parts
        ) / max(params_total, 1)
        art = Artifact(
            meta={"shards": meta_shards, "bits_per_weight": round(bpw, 4), "sizes": sizes}
        )
        self._put_files(store, tmp, art, files)
        return art

    def _shard(
        self, ctx, staged: Staged, fname: str, items: list[tuple[str, dict]], buf: bytearray
    ) -> int:
        """Write (or hard-link) one shard of ``items`` (name, store entry) at ``fname``; its body's
        bytes."""
        store, path = ctx.store, staged.tmp / fname
        head = packs.shard_header([(k, e["dtype"], e["shape"]) for k, e in items])
        body = sum(nbytes(e["dtype"], e["shape"]) for _, e in items)
        # what the shard's bytes follow from: the code writing them, its header, its tensors
        plan = keys.digest_json(
            "shard", [self.writer, keys.blob_digest(head), [e for _, e in items]]
        )
        digest = link_pack(store, items, head, body, path) or link_shard(store, plan, path)
        if digest is not None:
            staged.linked += 1
            ctx.progress.advance(len(items), len(head) + body)
        else:
            h = keys.blob_hasher()
            with DirectFile(path) as f:  # past the page cache: see DirectFile
                f.write(head)
                h.update(head)

                def sink(chunk, f=f, h=h):
                    f.write(chunk)
                    h.update(chunk)

                for _, e in items:
                    ctx.progress.advance(1, copy_entry(store, e, sink, buf))
            digest = keys.finish(h)
            with contextlib.suppress(OSError):  # refused (some network file systems): the
                settle(path)  # record is racy, and the next link hashes the file first
            store.put_memo("shard", plan, {"digest": digest})
        staged.shards[fname] = (digest, file_ident(path))
        return body

    @staticmethod
    def _put_files(store, tmp: Path, art: Artifact, files: dict[str, bytes]) -> None:
        for name, data in files.items():
            _safe_name(name)
            write_synced(tmp / name, data)
            art.files[name] = store.put_blob(data)
            art.meta["sizes"][name] = len(data)

    def _check(self, ctx: Context, staged: Staged, params: PublishParams) -> None:
        tmp, tensors = staged.tmp, staged.tensors
        idx = json.loads((tmp / "model.safetensors.index.json").read_text())
        seen: dict[str, str] = {}
        total = 0
        for shard in sorted(set(idx["weight_map"].values())):
            h = read_header(tmp / shard)
            if h.metadata.get("format") != "mlx":
                raise StepError(
                    f"{shard}: metadata format is {h.metadata.get('format')!r}, expected 'mlx'"
                )
            end = max((t.end for t in h.tensors.values()), default=0)
            if (size := (tmp / shard).stat().st_size) != end:  # e.g. padding left by a direct write
                raise StepError(f"{shard}: {size} bytes where its header accounts for {end}")
            for k, info in h.tensors.items():
                if k in seen:
                    raise StepError(f"tensor {k!r} is in both {seen[k]} and {shard}")
                seen[k] = shard
                total += info.nbytes
        if seen != idx["weight_map"] or set(seen) != set(tensors):
            raise StepError("index weight_map does not match the shards' contents")
        if total != idx["metadata"]["total_size"]:
            raise StepError(
                f"index total_size {idx['metadata']['total_size']} != {total} bytes in shards"
            )
        head = {k.removeprefix(HEAD_PREFIX) for k in tensors if k.startswith(HEAD_PREFIX)}
        if head:
            h = read_header(tmp / DRAFTER_SHARD)
            if h.metadata.get("format") != "mlx" or set(h.tensors) != head:
                raise StepError(
                    f"{DRAFTER_SHARD} does not hold the {len(head)} head tensors "
                    "under the drafter's names"
                )
        if params.load_check:
            loadcheck.check(
                ctx.store, tmp, staged.config, tensors, self.writer, staged.load_check, ctx.log
            )


def link_pack(store: Store, items: list[tuple[str, dict]], head: bytes, body: int, path: Path):
    """Hard-link, at ``path``, the pack that is this shard (``packs.py``: quantize wrote its
    tensors as this shard, under these names, in this order) while its stat vouches for its
    bytes (else it is hashed first); its digest, or None."""
    files = {e.get("pack", {}).get("file") for _, e in items}
    if len(files) != 1 or None in files or any(e["pack"]["tensor"] != k for k, e in items):
        return None
    (digest,) = files
    # by stat, else hashed: a pack written through a published link (same inode) is not linked
    pack = store.sources.find(digest)
    if pack is None:
        return None
    try:
        with open(pack, "rb") as f:
            if os.fstat(f.fileno()).st_size != len(head) + body or f.read(len(head)) != head:
                return None  # planned with another shard size (max_shard_bytes), say
        os.link(pack, path)
    except OSError:  # gone meanwhile, EXDEV, EMLINK, ...: the shard is written instead
        return None
    return digest


def link_shard(store: Store, plan: str, path: Path) -> str | None:
    """Hard-link, at ``path``, a file an earlier publish wrote from the same ``plan`` (header and
    store entries) and that is unchanged since (by stat, else by its hash); its digest, or None
    (never written, gone, changed, or on another file system: the shard is written instead)."""
    rec = store.get_memo("shard", plan) or {}
    old = store.sources.find(rec["digest"]) if "digest" in rec else None  # by stat, else hashed
    if old is None:
        return None
    try:
        os.link(old, path)
    except OSError:  # EXDEV, EPERM, EMLINK, ... or the file went meanwhile
        return None
    return rec["digest"]


def remember_shards(store: Store, dest: Path, shards: dict[str, tuple[str, list[int]]]) -> None:
    """Record the published shards for ``link_shard``. Each one's stat was taken in the private
    temp directory; since then the swap has made it public and removing the old directory may
    have unlinked a hard link to it, which changes only its ctime. A write by anyone else would
    have moved its mtime (which ``settle`` put in the past) to the present, and such a shard is
    not recorded."""
    for fname, (digest, ident) in shards.items():
        with contextlib.suppress(OSError):
            now = file_ident(dest / fname)
            if now[:4] == ident[:4]:  # device, inode, size, mtime
                store.sources.remember(dest / fname, digest, now)


def _safe_name(name: str) -> None:
    p = Path(name)
    if p.is_absolute() or ".." in p.parts or name.startswith("/"):
        raise StepError(
            f"refusing to write {name!r}: file names must stay inside the output directory"
        )
