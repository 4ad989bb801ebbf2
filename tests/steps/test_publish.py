"""publish: shard plans, the quantization config mlx_lm reads, merged reports, the atomic swap,
output-path checks, the model card, and the files it may write."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Project, shard_parts

from buildkit.core.errors import UsageError
from buildkit.engine.step import BuildOptions, Context, Progress
from buildkit.present.card import card_origin
from buildkit.quant.quantize import quantization_config
from buildkit.steps.publish import (
    STAMP,
    Publish,
    PublishParams,
    Staged,
    merge_reports,
    out_dir,
)
from buildkit.store.artifact import Artifact
from buildkit.store.packs import plan_shards
from buildkit.store.store import Store
from buildkit.store.swap import clear_leftovers, exchange


def context(tmp_path, out: Path | None = None) -> Context:
    return Context(
        Store(tmp_path / "store"),
        "publish",
        "v",
        BuildOptions(project_root=tmp_path, out_dir=out),
        Progress("publish"),
    )


# ---- shards ----------------------------------------------------------------------------------


def t(n: int, dtype: str = "U8") -> tuple[str, list[int]]:
    return dtype, [n]


def test_plan_shards_keeps_parts_apart_and_respects_the_size_limit():
    tensors = {
        "language_model.model.b": t(40),
        "language_model.model.a": t(30),
        "language_model.lm_head": t(50),
        "language_model.mtp.fc": t(10),
        "language_model.mtp.norm": t(10),
        "vision_tower.x": t(5),
        "vision_tower.big": t(500),  # larger than the limit: a shard of its own
    }
    assert plan_shards(tensors, 100) == [
        ["language_model.lm_head", "language_model.model.a"],  # 80; +40 would pass 100
        ["language_model.model.b"],
        [
            "language_model.mtp.fc",
            "language_model.mtp.norm",
        ],  # the head never shares with the trunk
        ["vision_tower.big"],
        ["vision_tower.x"],
    ]
    assert plan_shards(tensors, 10**6) == [
        ["language_model.lm_head", "language_model.model.a", "language_model.model.b"],
        ["language_model.mtp.fc", "language_model.mtp.norm"],
        ["vision_tower.big", "vision_tower.x"],
    ]
    assert plan_shards({"language_model.a": t(2, "F32"), "language_model.b": t(2, "F32")}, 16) == [
        ["language_model.a", "language_model.b"]
    ]  # exactly at the limit: one shard
    assert plan_shards({}, 100) == []


# ---- config.json's quantization ------------------------------------------------------------------


def quantized(quant: dict[str, dict], table: dict[str, dict]) -> Artifact:
    return Artifact(meta={"quantization": quant, "role_table": table})


Q8, Q6, Q4G32 = (
    {"group_size": g, "bits": b, "mode": "affine"} for g, b in ((64, 8), (64, 6), (32, 4))
)


def test_quantization_config_defaults_to_the_settings_covering_most_parameters():
    trunk = quantized(
        {"m.z_proj": Q8, "m.experts": Q6, "m.a_proj": Q8, "m.gate": Q8},
        {
            "attention": {"bits": 8, "tensors": 3, "params": 300},
            "expert": {"bits": 6, "tensors": 1, "params": 1000},
            "keep": {"passthrough": True, "tensors": 9, "params": 10**6},
        },  # passthrough weighs nothing
    )
    cfg = quantization_config([trunk])
    assert cfg == {
        "group_size": 64,
        "bits": 6,
        "mode": "affine",
        "m.a_proj": Q8,
        "m.gate": Q8,
        "m.z_proj": Q8,
    }
    assert list(cfg)[3:] == ["m.a_proj", "m.gate", "m.z_proj"]  # per-path entries sorted
    head = quantized(
        {"mtp.fc": Q4G32}, {"fc": {"bits": 4, "group_size": 32, "tensors": 1, "params": 5000}}
    )
    both = quantization_config([trunk, head])  # parts add up: now 4-bit g32 covers most
    assert {k: v for k, v in both.items() if "." not in k} == Q4G32
    assert sorted(k for k in both if "." in k) == ["m.a_proj", "m.experts", "m.gate", "m.z_proj"]
    assert (
        quantization_config(
            [Artifact(), quantized({}, {"keep": {"passthrough": True, "tensors": 1, "params": 1}})]
        )
        is None
    )


def test_merge_reports_scopes_the_names_of_scoped_checks():
    trunk = {"checks": {"finite": {"ok": True, "figure": 0}, "key_set": {"ok": True, "figure": 1}}}
    head = {"scope": "language_model.mtp.*", "checks": {"finite": {"ok": False, "figure": 2}}}
    merged = merge_reports([trunk, head])
    assert merged == {
        "ok": False,
        "checks": {
            "finite": {"ok": True, "figure": 0},
            "key_set": {"ok": True, "figure": 1},
            "finite (language_model.mtp.*)": {"ok": False, "figure": 2},
        },
    }
    assert merge_reports([trunk, {"scope": "all", "checks": {}}])["ok"] is True
    assert merge_reports([]) == {"ok": True, "checks": {}}


# ---- the output directory ------------------------------------------------------------------------


def test_exchange_swaps_two_directories(tmp_path):
    a, b = tmp_path / "new", tmp_path / "model"
    a.mkdir()
    b.mkdir()
    (a / "shard").write_text("new")
    (b / "shard").write_text("old")
    (b / "only-old").write_text("x")
    ino = b.stat().st_ino
    exchange(a, b)
    assert (b / "shard").read_text() == "new" and not (b / "only-old").exists()
    assert (a / "shard").read_text() == "old" and (a / "only-old").exists()
    assert a.stat().st_ino == ino  # the directories moved; nothing was copied
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "new"]


def test_out_dir_takes_the_template_or_the_command_line(tmp_path):
    assert out_dir(PublishParams(), context(tmp_path)) == tmp_path / "out" / "v"
    assert out_dir(PublishParams(out="/abs/{variant}-x"), context(tmp_path)) == Path("/abs/v-x")
    assert (
        out_dir(PublishParams(out="ignored"), context(tmp_path, Path("rel/o")))
        == tmp_path / "rel" / "o"
    )


def test_check_request_refuses_a_file_and_a_foreign_non_empty_directory(tmp_path):
    step = Publish()
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError) as e:
        step.check_request(PublishParams(), context(tmp_path, tmp_path / "file"))
    assert str(e.value) == (
        f"Cannot publish to {tmp_path / 'file'}: it is a file, not a directory. "
        "Pass --out with a directory path."
    )
    with pytest.raises(
        UsageError, match=f"Cannot publish to {tmp_path}/file/sub/out: {tmp_path}/file is a file"
    ):
        step.check_request(PublishParams(), context(tmp_path, tmp_path / "file" / "sub" / "out"))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(UsageError) as e:
        step.check_request(PublishParams(), context(tmp_path, foreign))
    assert str(e.value) == (
        f"Cannot publish to {foreign}: it exists and was not written by buildkit. "
        "Delete it or pass --out with a new path."
    )
    assert (foreign / "notes.txt").read_text() == "mine"
    # absent, empty, or written by buildkit before: fine
    empty, ours = tmp_path / "empty", tmp_path / "ours"
    empty.mkdir()
    ours.mkdir()
    (ours / STAMP).write_text("{}")
    (ours / "model-00001-of-00001.safetensors").write_bytes(b"")
    for ok in (tmp_path / "absent" / "deeper", empty, ours):
        assert step.check_request(PublishParams(), context(tmp_path, ok)) is None


def test_clear_leftovers_removes_only_dead_publishes_dirs_of_this_target(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = int(done.stdout)  # a process that has exited
    dest = tmp_path / "xl"
    names = [
        f".xl.tmp-{dead}",
        f".xl.old-{dead}",
        f".xl.tmp-{os.getpid()}",
        f".xl-mtp.tmp-{dead}",
        ".xl.tmp-x",
    ]
    for n in names:
        (tmp_path / n).mkdir()
        (tmp_path / n / "shard").write_text("x")
    clear_leftovers(dest)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])


def test_publish_writes_no_file_outside_its_directory(tmp_path):
    """Side-file names from a source artifact never leave the output directory."""
    store = Store(tmp_path / "store")
    out = tmp_path / "a" / "b" / "out"
    out.mkdir(parents=True)
    ctx = Context(store, "publish", "v", BuildOptions(project_root=tmp_path), Progress("publish"))
    blob = store.put_blob(b"evil")
    files = {
        "config.json": store.put_blob(b"{}"),
        "../evil.txt": blob,
        "/tmp/evil-abs.txt": blob,
        "sub/../../evil2.txt": blob,
        "merges.txt": blob,  # a side file a model directory keeps
    }
    staged = Staged(out, out, [], {}, {})
    Publish()._write(ctx, PublishParams(), staged, Artifact(files=files))
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "merges.txt",
        "model.safetensors.index.json",
    ]
    assert not list(tmp_path.rglob("evil*.txt")) and not Path("/tmp/evil-abs.txt").exists()
    # only a model directory's side files are copied (publish v4): a name like ".." is not one
    Publish()._write(ctx, PublishParams(), staged, Artifact(files={"..": blob}))
    assert not list(tmp_path.rglob("evil*")) and (tmp_path / "a" / "b").is_dir()


# ---- shards linked from packs or an earlier publish -----------------------------------------


def test_a_shard_changed_since_it_was_published_is_written_again(tmp_path, monkeypatch):
    """A shard is linked only while its file holds the bytes recorded for it: one changed in
    place (same size) is hashed again and found different, and a file system that refuses the
    link gets a copy. Either way the output is the bytes a clean build writes."""
    p = Project(tmp_path)
    p.build("xl")
    xl = shard_parts(p.out / "xl")
    want = {part: path.read_bytes() for part, path in xl.items()}

    monkeypatch.setattr(
        os, "link", lambda *a, **k: (_ for _ in ()).throw(OSError(18, "Invalid cross-device link"))
    )
    assert p.cli("build", "xl", "--out", str(p.out / "copied")) == 0
    copied = shard_parts(p.out / "copied")
    assert {part: path.read_bytes() for part, path in copied.items()} == want
    assert not any(os.path.samefile(copied[k], xl[k]) for k in xl)
    monkeypatch.undo()

    with open(xl["language_model"], "r+b") as f:  # in place: same inode, same size
        f.seek(len(want["language_model"]) // 2)
        f.write(bytes([want["language_model"][len(want["language_model"]) // 2] ^ 0x40]))
    os.unlink(copied["language_model"])  # the only other copy of the trunk's bytes
    mtp = p.build("xl-mtp")
    # the vision tower's and the head's packs; the trunk's pack was the file changed in place
    # (a hard link of it): found corrupt, removed, and quantize ran again
    assert "(3 of 4 shards hard-linked, not written)" in mtp.stderr
    assert "content does not match its digest; removed" in mtp.stderr
    b = shard_parts(p.out / "xl-mtp")
    assert b["language_model"].read_bytes() == want["language_model"]
    assert not os.path.samefile(b["language_model"], xl["language_model"])
    assert os.path.samefile(b["vision_tower"], xl["vision_tower"]) or os.path.samefile(
        b["vision_tower"], copied["vision_tower"]
    )


# ---- the model card ------------------------------------------------------------------------------


def test_card_origin_says_what_the_model_was_built_from():
    assert card_origin(
        PublishParams(), {"type": "hf", "repo": "Qwen/Qwen3.6-35B-A3B", "revision": "abc123"}
    ) == ("Qwen/Qwen3.6-35B-A3B", "Built from `Qwen/Qwen3.6-35B-A3B` at revision `abc123`.")
    assert card_origin(PublishParams(), {"type": "fixture", "spec": {"seed": 3, "layers": 2}}) == (
        None,
        "Built from a **generated test fixture** (`qwen3_5_moe` layout, random weights, spec "
        '`{"layers": 2, "seed": 3}`): not a real model.',
    )
    assert card_origin(PublishParams(), {"type": "local"}) == (
        None,
        "Built from a local checkpoint directory.",
    )
    assert card_origin(PublishParams(), {}) == (None, "Built from a local checkpoint directory.")
    mine = PublishParams(base_model="me/base")
    assert card_origin(mine, {"type": "hf", "repo": "Qwen/X", "revision": "r"}) == (
        "me/base",
        "Built from `me/base`.",
    )


def test_the_card_of_a_built_seed_states_its_source_and_settings(seed):
    store = Store(seed.store)
    for variant in ("xl", "xl-mtp"):
        card = (seed.out / variant / "README.md").read_text()
        art = store.get_artifact(store.get_ref(variant)["nodes"]["publish"]["outputs"]["out"])
        assert card.startswith(
            "---\nlibrary_name: mlx\npipeline_tag: image-text-to-text\n"
            "tags:\n- mlx\n- quantized\n- qwen3_5_moe\n"
        )
        assert (
            f"\n# {variant}\n\nMLX build of a qwen3_5_moe checkpoint, variant `{variant}`, "
            "made with buildkit.\n" in card
        )
        assert (
            "\nBuilt from buildkit's small **trained test checkpoint** (`qwen3_5_moe` layout, "
            "trained on a public-domain text): not a real model.\n" in card
        )
        assert (
            "- bits per weight (stored bits / source weights): "
            f"**{art.meta['bits_per_weight']:.3f}**\n" in card
        )
        assert (
            "| trunk | routed_expert | 6 | 64 |" in card
            and "| trunk | keep | passthrough |  |" in card
        )
        assert (
            ("- mtp\n" in card)
            == ("(includes the MTP head `language_model.mtp.*`)" in card)
            == (variant == "xl-mtp")
        )


def test_an_existing_empty_directory_is_published_into(project, seed):
    """check_request lets an empty directory through, so publish itself must too: refusing it
    there would fail the build only after every other step had run."""
    project.adopt(seed)
    empty = project.root / "empty"
    empty.mkdir()
    assert project.cli("build", "xl", "-q", "--out", str(empty)) == 0
    assert (empty / STAMP).exists() and (empty / "README.md").exists()
    assert sorted(p.name for p in empty.glob("model-*.safetensors")) == sorted(
        p.name for p in (seed.out / "xl").glob("model-*.safetensors")
    )


def test_publish_copies_only_the_files_a_model_directory_needs(project, tmp_path):
    """Tokenizer, processor configs, chat template and generation config come from the source;
    a source's other files (a README.txt, a held-out text, notes in a folder) stay behind."""
    from buildkit.fixtures.generated import FixtureSpec, generate

    src = generate(tmp_path / "src", FixtureSpec())
    own = {p.name for p in src.iterdir() if not p.name.endswith(".safetensors")}
    (src / "README.txt").write_text("how this checkpoint was made\n")
    (src / "heldout.txt").write_text("text kept out of training\n")
    (src / "notes").mkdir()
    (src / "notes" / "eval.json").write_text("{}\n")
    project.build("xl", "--source", str(src))
    out = project.out / "xl"
    published = {p.name for p in out.iterdir() if p.is_file() and not p.name.startswith(".")}
    assert not {"README.txt", "heldout.txt", "notes"} & published and not (out / "notes").exists()
    assert own - {"model.safetensors.index.json"} <= published  # config.json is publish's own
    assert {"tokenizer.json", "chat_template.jinja", "preprocessor_config.json"} <= published
    for name in own - {"config.json", "model.safetensors.index.json"}:
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    assert "how this checkpoint was made" not in (out / "README.md").read_text()
