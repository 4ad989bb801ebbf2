"""hf:// sources and --push against a Hub-compatible server on 127.0.0.1 (tests/hubserver.py):
downloads verified against the Hub's hashes, resumed, refused when corrupt; estimates from
headers alone; a pushed model that loads; errors that say what to do."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Project, cached, ran
from hubserver import Hub

from buildkit.fixtures.generated import FixtureSpec, generate

SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
BIG = FixtureSpec(experts=192)  # shards of ~24 MB: past huggingface_hub's 10 MiB read chunk


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return generate(tmp_path_factory.mktemp("hub-src") / "tiny", FixtureSpec())


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    return generate(tmp_path_factory.mktemp("hub-big") / "big", BIG)


@pytest.fixture
def hub():
    with Hub() as h:
        yield h


def client_env(hub: Hub, home: Path, token: str | None = None) -> dict[str, str]:
    """The test's environment pointed at ``hub``: a fresh HF cache, no token unless given."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_CACHE", "HF_XET_CACHE")
    }
    env.update(hub.env(home))
    if token is not None:
        env["HF_TOKEN"] = token
    return env


def build(p: Project, variant: str, *extra: str, env: dict, check: bool = True):
    return p.run("build", variant, "--out", str(p.out / variant), *extra, env=env, check=check)


def hf_cache_blobs(home: Path) -> list[Path]:
    return sorted(p for p in (home / "hub").rglob("blobs/*") if p.is_file())


def store_records(p: Project) -> list[Path]:
    """Action and artifact records: what a step leaves in the store once it has finished."""
    return [f for d in ("actions", "artifacts") for f in (p.store / d).rglob("*") if f.is_file()]


def test_build_from_the_hub_then_push_and_load_what_was_pushed(project, hub, small, tmp_path):
    sha = hub.upload_dir("org/tiny", small)
    src = f"hf://org/tiny@{sha}"
    # without a token the build stands and the push says what it needs
    r = project.run(
        "build", "xl-mtp", "--source", src, "--out", str(project.out / "xl-mtp"),
        "--push", "me/xl-mtp", env=client_env(hub, tmp_path / "hf"), check=False,
    )  # fmt: skip
    assert r.returncode == 1 and "publish" in ran(r), r.stderr
    assert "cannot push" in r.stderr and "HF_TOKEN to a token that may write to me/xl-mtp" in (
        r.stderr
    )
    assert "me/xl-mtp" not in hub.repos and all(e[0] != "PUT" for e in hub.requests)
    files = sorted(p.name for p in small.iterdir())
    assert f"verified {len(files)} downloaded files of hf://org/tiny@{sha}" in r.stderr
    # every file came once, whole; the shards as LFS files (X-Linked-Etag: their sha256)
    assert dict(hub.served) == {f: (small / f).stat().st_size for f in files}
    blobs = {b.name for b in hf_cache_blobs(tmp_path / "hf")}
    assert {hashlib.sha256((small / s).read_bytes()).hexdigest() for s in (SHARD1, SHARD2)} <= blobs

    # with one, nothing is rebuilt: a new repo holds the published directory, shards in LFS
    env = client_env(hub, tmp_path / "hf", token=hub.token)
    r = build(project, "xl-mtp", "--source", src, "--push", "me/xl-mtp", env=env)
    assert ran(r) == [] and "uploaded" in r.stdout
    out = project.out / "xl-mtp"
    local = {
        p.relative_to(out).as_posix(): p.read_bytes()
        for p in out.rglob("*")
        if p.is_file() and not p.name.startswith(".")
    }
    pushed = hub.files("me/xl-mtp")
    assert {k: b.data for k, b in pushed.items() if k != ".gitattributes"} == local
    assert {"README.md", "config.json", "mtp/model.safetensors", "mtp/config.json"} <= set(local)
    shards = sorted(k for k in local if k.endswith(".safetensors"))
    assert all(pushed[k].lfs and pushed[k].sha256 in hub.lfs_objects for k in shards)
    assert ("POST", "/me/xl-mtp.git/info/lfs/objects/batch", None) in hub.requests
    assert "base_model: org/tiny" in local["README.md"].decode()

    # a fresh download of what was pushed loads in mlx_lm and in mlx_vlm (with its drafter)
    script = """
import json, sys
import mlx.core as mx
import mlx.nn as nn
from huggingface_hub import snapshot_download
path = snapshot_download("me/xl-mtp")
from mlx_lm import load
model, tok = load(path)
logits = model(mx.array([tok.encode("Hello")]))
from mlx_vlm import load as vlm_load
vmodel, _ = vlm_load(path)
qkv = vmodel.vision_tower.blocks[0].attn.qkv
print(json.dumps({"path": path, "logits": list(logits.shape),
                  "finite": bool(mx.isfinite(logits.astype(mx.float32)).all().item()),
                  "vision_qkv": [type(qkv).__name__, qkv.bits]}))
"""
    env_fresh = client_env(hub, tmp_path / "fresh")
    got = subprocess.run(
        [sys.executable, "-c", script], env=env_fresh, capture_output=True, text=True
    )
    assert got.returncode == 0, got.stderr[-3000:]
    res = json.loads(got.stdout.strip().splitlines()[-1])
    assert res["path"].startswith(str(tmp_path / "fresh"))
    assert res["logits"][-1] == 512 and res["finite"]
    assert res["vision_qkv"] == ["QuantizedLinear", 6]


def test_a_dropped_connection_resumes_and_the_file_is_verified(project, hub, big, tmp_path):
    sha = hub.upload_dir("org/big", big)
    size = (big / SHARD1).stat().st_size
    cut = 11 << 20  # one whole 10 MiB read chunk reaches the file before the cut
    assert size > cut
    hub.drop_after(SHARD1, cut)
    env = client_env(hub, tmp_path / "hf")
    r = build(project, "xl", "--source", f"hf://org/big@{sha}", "--target", "fetch", env=env)
    assert ran(r) == ["fetch"] and "verified" in r.stderr
    gets = [rng for m, path, rng in hub.requests if m == "GET" and path.endswith(SHARD1)]
    assert gets[0] is None and gets[1] == f"bytes={10 << 20}-"  # resumed, not started over
    assert hub.served[SHARD1] == cut + size - (10 << 20)
    want = hashlib.sha256((big / SHARD1).read_bytes()).hexdigest()
    (blob,) = [b for b in hf_cache_blobs(tmp_path / "hf") if b.name == want]
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == want
    # a second build asks nothing of the Hub: the pinned commit is in the HF cache, checked
    n = len(hub.requests)
    again = build(project, "xl", "--source", f"hf://org/big@{sha}", "--target", "fetch", env=env)
    assert cached(again) == ["fetch"] and len(hub.requests) == n


@pytest.mark.parametrize("name", [SHARD2, "tokenizer.json"])  # an LFS file, a git blob
def test_bytes_that_do_not_match_the_hubs_hash_are_refused(project, hub, small, tmp_path, name):
    sha = hub.upload_dir("org/tiny", small)
    hub.corrupt(name)
    env = client_env(hub, tmp_path / "hf")
    src = f"hf://org/tiny@{sha}"
    r = build(project, "xl", "--source", src, "--target", "fetch", env=env, check=False)
    algo = "sha256" if name.endswith(".safetensors") else "git-sha1"
    assert r.returncode == 1, r.stderr
    assert f"{src}: {name}: its bytes do not match the Hub's {algo}" in r.stderr
    assert "run the build again" in r.stderr
    # nothing half-written: no record in the store, the bad bytes gone from the HF cache
    assert store_records(project) == []
    etag = hub.files("org/tiny")[name].etag
    assert etag not in {b.name for b in hf_cache_blobs(tmp_path / "hf")}
    # the fault was once: the rerun the message asks for downloads the file again and builds
    ok = build(project, "xl", "--source", src, "--target", "fetch", env=env)
    assert ran(ok) == ["fetch"]
    assert etag in {b.name for b in hf_cache_blobs(tmp_path / "hf")}


def test_estimate_reads_only_headers_from_the_hub(project, hub, big, tmp_path, capsys):
    sha = hub.upload_dir("org/big", big)
    env = client_env(hub, tmp_path / "hf")
    r = project.run("estimate", "xl-mtp", "--source", f"hf://org/big@{sha}", "--json", env=env)
    remote = json.loads(r.stdout)
    shards = sum(f.stat().st_size for f in big.glob("*.safetensors"))
    served = sum(hub.served.values())  # config, index and header range reads
    assert served < 0.01 * shards, (served, shards)
    assert all(m != "GET" or rng for m, p, rng in hub.requests if p.endswith(".safetensors"))
    capsys.readouterr()
    assert project.cli("estimate", "xl-mtp", "--source", str(big), "--json") == 0
    local = json.loads(capsys.readouterr().out)
    assert {**remote, "source": None} == {**local, "source": None}


def fetch_error(project: Project, env: dict, source: str) -> subprocess.CompletedProcess:
    return build(project, "xl", "--source", source, "--target", "fetch", env=env, check=False)


def test_errors_say_what_to_do(project, hub, small, tmp_path):
    sha = hub.upload_dir("org/tiny", small)
    hub.create("org/gated", gated=True)
    hub.commit("org/gated", {p.name: p.read_bytes() for p in small.iterdir()})
    home = tmp_path / "hf"

    for token, status in ((None, 401), (hub.token, 403)):  # no token; a token without the terms
        r = fetch_error(project, client_env(hub, home, token), "hf://org/gated@main")
        assert r.returncode == 1, r.stderr
        assert f"org/gated is a gated repository these credentials may not read ({status})" in (
            r.stderr
        )
        assert f"accept the terms at {hub.url}/org/gated" in r.stderr and "set HF_TOKEN" in r.stderr

    r = project.run(
        "estimate", "xl", "--source", "hf://org/gated@main", env=client_env(hub, home), check=False
    )
    assert r.returncode == 1 and "cannot estimate from hf://org/gated@main" in r.stderr
    assert f"accept the terms at {hub.url}/org/gated" in r.stderr
    r = fetch_error(project, client_env(hub, home), f"hf://org/absent@{sha}")
    assert r.returncode == 2 and f"no repository org/absent at {hub.url}" in r.stderr
    assert "check the name" in r.stderr and "set HF_TOKEN" in r.stderr
    r = fetch_error(project, client_env(hub, home), "hf://org/tiny@v9")
    assert r.returncode == 2 and "org/tiny has no revision 'v9' (404)" in r.stderr
    r = fetch_error(project, client_env(hub, home, "hf_wrong"), f"hf://org/tiny@{sha}")
    assert r.returncode == 1 and "the Hub refused the credentials (401), HF_TOKEN is set" in (
        r.stderr
    )
    assert f"set HF_TOKEN to a token that may read org/tiny (create one at {hub.url}" in r.stderr


def test_a_server_gone_mid_download_says_so_and_leaves_nothing(project, hub, small, tmp_path):
    sha = hub.upload_dir("org/tiny", small)
    hub.gone_after(SHARD1, 1000)
    home = tmp_path / "hf"
    r = fetch_error(project, client_env(hub, home), f"hf://org/tiny@{sha}")
    assert r.returncode == 1, r.stderr
    assert f"cannot fetch hf://org/tiny@{sha}: lost the connection to {hub.url}" in r.stderr
    assert "run the build again" in r.stderr and "Traceback" not in r.stderr
    assert store_records(project) == []
    leftovers = [p for p in (home / "hub").rglob("*") if p.name.endswith(".incomplete")]
    assert leftovers == [] and hub.files("org/tiny")[SHARD1].sha256 not in {
        b.name for b in hf_cache_blobs(home)
    }


def test_a_cached_file_that_is_no_blob_link_is_checked_against_the_hubs_tree(
    project, hub, small, tmp_path
):
    """A snapshot file put in place by other means (no symlink to a blob named by its etag) is
    checked against the Hub's tree listing; one that differs is refused and removed."""
    sha = hub.upload_dir("org/tiny", small)
    env = client_env(hub, tmp_path / "hf")
    src = f"hf://org/tiny@{sha}"
    build(project, "xl", "--source", src, "--target", "fetch", env=env)
    (snap,) = (tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots").iterdir()
    tok = snap / "tokenizer.json"
    data = tok.read_bytes()
    tok.unlink()
    tok.write_bytes(data.replace(b"<|im_end|>", b"<|im_fin|>"))
    r = build(project, "xl", "--source", src, "--target", "fetch", env=env, check=False)
    assert r.returncode == 1 and f"{src}: tokenizer.json: its bytes do not match" in r.stderr
    assert ("GET", f"/api/models/org/tiny/tree/{sha}", None) in hub.requests[-3:]
    assert not tok.exists()
    tok.write_bytes(data)  # the right bytes, still no link: checked against the tree, taken
    build(project, "xl", "--source", src, "--target", "fetch", env=env)


def test_a_branch_resolves_to_its_commit_through_the_revision_api(project, hub, small, tmp_path):
    sha = hub.upload_dir("org/tiny", small)
    r = build(project, "xl", "--source", "hf://org/tiny@main", "--target", "fetch",
              env=client_env(hub, tmp_path / "hf"))  # fmt: skip
    assert ran(r) == ["fetch"] and "hf://org/tiny@main is not pinned to a commit" in r.stderr
    assert ("GET", "/api/models/org/tiny/revision/main", None) in hub.requests
    snaps = tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots"
    assert [p.name for p in snaps.iterdir()] == [sha]


def test_a_worker_reads_one_tensor_by_range_and_only_from_the_file_indexed(
    hub, small, tmp_path, monkeypatch
):
    """``detached.DetachedStore``: a source tensor read by HTTP Range from the Hub (its header,
    then its bytes, once); a file whose sha256 or size is not the one the client indexed is
    refused, naming the URL."""
    from buildkit.core.errors import SourceError
    from buildkit.formats.tensors import read_header
    from buildkit.store.detached import DetachedStore
    from buildkit.store.hub import range_ref
    from buildkit.store.store import Store

    sha = hub.upload_dir("org/tiny", small)
    env = client_env(hub, tmp_path / "hf")
    script = (
        "import sys; from huggingface_hub import snapshot_download as s; "
        f"print(s('org/tiny', revision='{sha}'))"
    )
    snap = Path(subprocess.run([sys.executable, "-c", script], env=env, check=True,
                               capture_output=True, text=True).stdout.strip())  # fmt: skip
    from huggingface_hub import constants

    # as HF_ENDPOINT sets them when huggingface_hub is imported in a client process
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    template = hub.url + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    client = Store(tmp_path / "client")
    digest = client.sources.digest_file(snap / SHARD1)
    ref = range_ref(snap / SHARD1)
    want = hashlib.sha256((small / SHARD1).read_bytes()).hexdigest()
    assert ref["sha256"] == want and ref["url"].startswith(hub.url)
    info = next(t for t in read_header(small / SHARD1).tensors.values() if t.nbytes > 1000)
    entry = {"dtype": info.dtype, "shape": list(info.shape),
             "view": {"file": digest, "tensor": info.name}}  # fmt: skip
    hub.requests.clear()
    worker = DetachedStore(tmp_path / "worker", "file:///nonexistent", {digest: ref}, "w0")
    got = worker.read_tensor(entry)
    assert got.tobytes() == (small / SHARD1).read_bytes()[info.start : info.end]
    worker.read_tensor(entry)  # kept: not read again
    n = int.from_bytes((small / SHARD1).read_bytes()[:8], "little")
    ranges = [r for _, p, r in hub.requests if p.endswith(SHARD1)]
    assert ranges == ["bytes=0-7", f"bytes=8-{7 + n}", f"bytes={info.start}-{info.end - 1}"]

    for bad in ({**ref, "sha256": "0" * 64}, {**ref, "size": ref["size"] + 1}):
        other = DetachedStore(tmp_path / "other", "file:///nonexistent", {digest: bad}, "w1")
        with pytest.raises(SourceError, match=r"worker w1: .* not the same file") as e:
            other.read_tensor(entry)
        assert ref["url"] in str(e.value)
