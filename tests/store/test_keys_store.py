"""Keys (canonical JSON, pinned digests) and the store (objects, corruption, locks, gc, check).

Durable writes are tested in test_fsio.py, the source index in test_sources.py."""

from __future__ import annotations

import json
import shutil
import threading
import time

import numpy as np
import pytest
import xxhash
from conftest import cached, ran

from buildkit.core import keys
from buildkit.core.errors import StoreMiss
from buildkit.store.artifact import Artifact, objects
from buildkit.store.store import Store

# ---- keys ----------------------------------------------------------------------------------


def test_canonical_json_is_order_and_whitespace_independent():
    a = {"b": 1, "a": [1, {"d": 2.5, "c": "é"}]}
    b = json.loads('{ "a": [1, {"c": "é", "d": 2.5}],\n "b": 1 }')
    assert (
        keys.canonical_json(a)
        == keys.canonical_json(b)
        == '{"a":[1,{"c":"é","d":2.5}],"b":1}'.encode()
    )
    assert keys.digest_json("t", a) == keys.digest_json("t", b)
    assert keys.canonical_json([2, 1]) != keys.canonical_json([1, 2])  # lists keep their order
    with pytest.raises(ValueError):
        keys.canonical_json({"x": float("nan")})


def test_digests_are_pinned():
    """Changing how anything is hashed changes every key in every store: it must be deliberate."""
    assert keys.digest_json(
        "action", {"kind": "quantize", "version": 1, "params": {"bits": 6}}
    ) == ("xxh3_128:e8f3e8eec1a15715a110012259c46274")
    assert (
        keys.tensor_digest("BF16", [2, 3], bytes(range(12)))
        == "xxh3_128:1516ce38591f7cc0e58e5513ef22fccb"
    )
    assert keys.blob_digest(b"hello\n") == "xxh3_128:b64f11bb105ad27c8cb6085f727ca64c"


def test_digest_scheme():
    """tag NUL canonical-json; tensors seeded with dtype and shape; blobs tagged: no collisions."""
    value = {"z": [1, 2], "a": None}
    raw = xxhash.xxh3_128(b"action\0" + b'{"a":null,"z":[1,2]}').hexdigest()
    assert keys.digest_json("action", value) == "xxh3_128:" + raw
    assert keys.digest_json("artifact", value) != keys.digest_json("action", value)
    data = bytes(range(12))
    assert (
        len(
            {
                keys.tensor_digest("BF16", [2, 3], data),
                keys.tensor_digest("BF16", [3, 2], data),
                keys.tensor_digest("F16", [2, 3], data),
                keys.blob_digest(data),
            }
        )
        == 4
    )
    h = keys.tensor_hasher("BF16", (2, 3))
    h.update(data[:5])
    h.update(memoryview(data)[5:])
    assert keys.finish(h) == keys.tensor_digest("BF16", [2, 3], data)
    d = keys.blob_digest(data)
    assert keys.is_digest(d) and not keys.is_digest(d[:-1]) and not keys.is_digest(d.upper())
    assert keys.short(d) == d.removeprefix("xxh3_128:")[:12]


def test_fetch_and_sanitize_keys_of_the_default_fixture_are_pinned(seed):
    """The default source (the trained fixture) is written byte-identical on any machine and
    neither step hashes a library version, so these keys hold everywhere (quantize's holds only
    per mlx version)."""
    ref = json.loads((seed.store / "refs" / "xl.json").read_text())
    assert ref["keys"]["fetch"] == "xxh3_128:f7e38d65f514fc4b98ece075018e26f1"
    assert ref["keys"]["sanitize"] == "xxh3_128:59759e2ade764d5b266ed1224d520f53"
    assert ref["nodes"]["sanitize"]["outputs"] == {
        "model": "xxh3_128:62a7b55d83474935dce5dd7057e78f5e",
        "mtp": "xxh3_128:7a175ed2af7ec26439475b47d2b6ca1f",
    }
    mtp = json.loads((seed.store / "refs" / "xl-mtp.json").read_text())
    for node in ("fetch", "sanitize", "quantize"):  # xl-mtp's trunk is xl's, key for key
        assert mtp["keys"][node] == ref["keys"][node]


# ---- store primitives ----------------------------------------------------------------------


def test_objects_are_fanned_out_deduplicated_and_verified_on_read(tmp_path, capsys):
    store = Store(tmp_path / "s")
    arr = np.arange(12, dtype=np.uint16).reshape(3, 4)
    e = store.put_tensor("BF16", arr)
    assert e == {
        "dtype": "BF16",
        "shape": [3, 4],
        "digest": keys.tensor_digest("BF16", [3, 4], arr.tobytes()),
    }
    hexd = e["digest"].removeprefix("xxh3_128:")
    path = tmp_path / "s" / "objects" / hexd[:2] / hexd[2:]
    assert path.read_bytes() == arr.tobytes()
    store.put_tensor("BF16", arr)
    assert store.stats.objects_written == 1
    assert (store.read_tensor(e) == arr).all()

    path.write_bytes(b"\xff" + arr.tobytes()[1:])  # same size, wrong content
    with pytest.raises(
        StoreMiss, match=f"store object {hexd[:12]} was corrupt and has been removed"
    ):
        store.read_tensor(e)
    assert not path.exists()
    assert "content does not match its digest; removed" in capsys.readouterr().err
    with pytest.raises(StoreMiss, match="missing"):
        store.read_tensor(e)

    blob = store.put_blob(b"{}")
    store.object_path(blob).write_bytes(b"[]")
    with pytest.raises(StoreMiss):
        store.get_blob(blob)
    assert not store.has_object(blob)


def test_an_action_is_a_hit_only_when_whole(tmp_path, capsys):
    store = Store(tmp_path / "s")
    art = Artifact(
        tensors={"w": store.put_tensor("F32", np.ones(4, np.float32))},
        files={"f": store.put_blob(b"x")},
    )
    key = keys.digest_json("action", {"test": 1})
    store.put_action(key, {"key": key, "outputs": {"out": store.put_artifact(art)}})
    assert store.get_action(key)["outputs"] == {"out": art.digest}
    assert store.get_artifact(art.digest) == art

    store.object_path(art.tensors["w"]["digest"]).write_bytes(b"short")  # truncated object
    assert store.get_action(key) is None
    assert not store.has_object(art.tensors["w"]["digest"])

    store.put_tensor("F32", np.ones(4, np.float32))
    assert store.get_action(key) is not None
    listing = store.root / "artifacts" / art.digest[9:11] / art.digest[11:]
    listing.write_text(listing.read_text().replace('"f"', '"g"'))  # tampered listing
    assert store.get_action(key) is None and not listing.exists()

    store.put_artifact(art)
    action = store.root / "actions" / key[9:11] / key[11:]
    action.write_text("{not json")
    assert store.get_action(key) is None and not action.exists()
    assert "action record is corrupt; removed" in capsys.readouterr().err


def test_lock_excludes_other_holders(tmp_path):
    store, other = (
        Store(tmp_path / "s"),
        Store(tmp_path / "s"),
    )  # separate open files, as two processes
    events = []
    entered = threading.Event()

    def second():
        entered.set()
        with other.lock("k"):
            events.append("second")

    with store.lock("k"):
        t = threading.Thread(target=second)
        t.start()
        entered.wait()
        time.sleep(0.2)
        events.append("first")
    t.join(5)
    assert events == ["first", "second"]


# ---- the store under builds ----------------------------------------------------------------


def _quantize_only_object(store: Store, ref: dict) -> str:
    """An object of xl's quantize output (a pack) that no other artifact of xl holds."""
    art = store.get_artifact(ref["nodes"]["quantize"]["outputs"]["out"])
    others = {
        d
        for n in ("fetch", "sanitize")
        for a in ref["nodes"][n]["outputs"].values()
        for d in objects(store.get_artifact(a))
    }
    return sorted(set(objects(art)) - others)[0]


def _flip(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _published(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


def test_corrupt_object_is_removed_and_rebuilt_never_served(project, seed):
    project.adopt(seed)
    store = Store(project.store)
    ref = store.get_ref("xl")
    want = _published(project.out / "xl")
    digest = _quantize_only_object(store, ref)
    _flip(store.object_path(digest))
    # a no-op build reads no tensor bytes, so delete the output to make publish read them all,
    # and the store's records of files outside it: publish would link a shard published before
    shutil.rmtree(project.out / "xl")
    shutil.rmtree(project.store / "sources")
    b = project.build("xl")
    assert f"{store.object_path(digest)}: content does not match its digest; removed" in b.stderr
    assert f"store object {keys.short(digest)} was corrupt and has been removed" in b.stderr
    assert ran(b) == ["publish", "quantize", "publish"]  # found by publish, restored by quantize
    assert (
        "[run]    quantize (quantize): output missing from the store (collected or corrupt)\n"
        in b.stderr
    )
    assert _published(project.out / "xl") == want
    assert store.object_path(digest).exists()
    assert ran(project.build("xl")) == []


def test_deleted_action_record_reruns_the_node_with_a_reason(project, seed):
    project.adopt(seed)
    key = json.loads((project.store / "refs" / "xl.json").read_text())["keys"]["quantize"]
    (project.store / "actions" / key[9:11] / key[11:]).unlink()
    plan = project.run("plan", "xl").stdout
    assert (
        f"stale quantize (quantize) {keys.short(key)}: "
        "output missing from the store (collected or corrupt)\n" in plan
    )
    b = project.build("xl")
    assert ran(b) == ["quantize"]  # same bytes again: verify and publish stay cached
    assert sorted(cached(b)) == ["eval", "fetch", "publish", "reference", "sanitize", "verify"]

    (project.store / "refs" / "xl.json").unlink()
    for root in (project.store / "roots").iterdir():  # each build request remembers its nodes too
        root.unlink()
    (project.store / "actions" / key[9:11] / key[11:]).unlink()
    assert (
        f"stale quantize (quantize) {keys.short(key)}: never built\n"
        in project.run("plan", "xl").stdout
    )


def _objects(store: Store) -> set[str]:
    return {p.parent.name + p.name for p in (store.root / "objects").glob("*/*")}


def _reachable(store: Store, ref: dict) -> set[str]:
    out = set()
    for node in ref["nodes"].values():
        for d in node["outputs"].values():
            art = store.get_artifact(d)
            out |= {d[9:] for d in objects(art)}
    return out


def test_gc_frees_what_only_a_deleted_variant_used(project, seed, capsys):
    project.adopt(seed)
    # earlier tests read and write the shared seed's store: start from what its builds reach
    assert project.cli("gc") == 0
    capsys.readouterr()
    store = Store(project.store)
    xl, mtp = _reachable(store, store.get_ref("xl")), _reachable(store, store.get_ref("xl-mtp"))
    mtp_only = mtp - xl
    assert mtp_only and _objects(store) == xl | mtp
    assert project.cli("forget", "xl-mtp") == 0
    assert "forgot build xl-mtp (source fixture:trained, out default)" in capsys.readouterr().out

    assert project.cli("gc", "--dry-run") == 0
    dry = capsys.readouterr().out
    assert _objects(store) == xl | mtp
    freed = sum(store.object_path("xxh3_128:" + d).stat().st_size for d in mtp_only)
    assert project.cli("gc") == 0
    out = capsys.readouterr().out
    assert (
        out.replace("freed", "would free") == dry.splitlines(keepends=True)[-1]
    )  # the last line is the sum
    assert (
        "xl-mtp:\n  eval_head: 1 action(s)" in dry and "  verify_head: 1 action(s)" in dry
    )  # listed by variant, step
    m = json.loads("[" + out.split("(", 1)[1].split(" bytes")[0] + "]")
    assert m[0] > freed  # objects plus the listings and action records that named them
    assert f"{len(mtp_only)} objects" in out and out.startswith("freed ")
    assert _objects(store) == xl

    assert project.cli("gc") == 0
    assert (
        capsys.readouterr().out
        == "freed 0.0 MB (0 bytes): 0 actions, 0 artifacts, 0 objects, 0 memos, "
        "0 records of deleted files\n"
    )
    assert ran(project.build("xl")) == []
    b = project.build("xl-mtp")
    assert sorted(ran(b)) == ["eval_head", "graft", "publish", "requantize", "verify_head"]


def test_store_check_finds_and_removes_a_corrupt_object(project, seed):
    project.adopt(seed)
    store = Store(project.store)
    clean = project.run("store", "check")
    assert clean.stdout == "0 corrupt entries\n"
    digest = _quantize_only_object(store, store.get_ref("xl"))
    _flip(store.object_path(digest))
    bad = project.run("store", "check", check=False)
    assert bad.returncode == 1
    assert bad.stdout == (
        f"object {keys.short(digest)}: content does not match its digest\n"
        "1 corrupt entries (removed; rebuild to restore)\n"
    )
    assert not store.object_path(digest).exists()
    assert project.run("store", "check").returncode == 0
    assert ran(project.build("xl")) == ["quantize"]


def test_gc_refuses_while_a_build_holds_the_store(tmp_path):
    from buildkit.core.errors import StoreError
    from buildkit.store.store import Store

    store = Store(tmp_path / "cache")
    with store.in_use():  # what a running build holds
        with pytest.raises(StoreError, match="a build is using the store"):
            Store(tmp_path / "cache").gc()
    assert Store(tmp_path / "cache").gc()["objects"] == 0


# ---- quantizing in blocks of rows ------------------------------------------------------------


def _source(tmp_path, tensors: dict[str, np.ndarray]):
    """A safetensors file of bf16 bit patterns (uint16 arrays), hashed into a new store."""
    from buildkit.formats.tensors import header_bytes

    path = tmp_path / "src.safetensors"
    with open(path, "wb") as f:
        f.write(header_bytes([(k, "BF16", v.shape) for k, v in tensors.items()], {}))
        for v in tensors.values():
            f.write(v.tobytes())
    store = Store(tmp_path / "cache")
    return store, store.sources.digest_file(path)


def _bf16(rng, shape) -> np.ndarray:
    return ((rng.standard_normal(shape, dtype=np.float32) * 0.02).view(np.uint32) >> 16).astype(
        np.uint16
    )


@pytest.mark.parametrize("block_rows", [1, 3, 1000])
def test_quantizing_in_blocks_of_rows_gives_the_whole_tensors_bytes(tmp_path, block_rows):
    """mx.quantize's groups run along the last axis, so quantize may stream a tensor in blocks of
    rows: the stored entries (and so their digests) are those of quantizing it whole, for a
    plain view, the gate and up halves of a fused experts tensor, a store object, and a view
    whose rows are not its source's (read whole, handed out in blocks)."""
    import mlx.core as mx

    from buildkit.formats.tensors import from_mlx, to_mlx
    from buildkit.quant.quantize import quantize_entry
    from buildkit.quant.roles import Role

    rng = np.random.default_rng(block_rows)
    fused, plain = _bf16(rng, (7, 10, 128)), _bf16(rng, (11, 192))
    store, digest = _source(tmp_path, {"fused": fused, "plain": plain})
    obj = store.put_tensor("BF16", _bf16(rng, (9, 3, 64)))
    cases = {
        "plain": (
            plain,
            {"dtype": "BF16", "shape": [11, 192], "view": {"file": digest, "tensor": "plain"}},
        ),
        "gate": (
            fused[:, :5],
            {
                "dtype": "BF16",
                "shape": [7, 5, 128],
                "view": {"file": digest, "tensor": "fused", "slice": [1, 0, 5]},
            },
        ),
        "up": (
            fused[:, 5:],
            {
                "dtype": "BF16",
                "shape": [7, 5, 128],
                "view": {"file": digest, "tensor": "fused", "slice": [1, 5, 10]},
            },
        ),
        "object": (store.read_tensor(obj), obj),
        "reshaped": (
            plain.reshape(33, 64),
            {"dtype": "BF16", "shape": [33, 64], "view": {"file": digest, "tensor": "plain"}},
        ),
    }
    for bits in (4, 6, 8):
        role = Role(bits=bits, group_size=64)
        for name, (raw, entry) in cases.items():
            row_bytes = raw.nbytes // raw.shape[0]
            got = quantize_entry(
                store, f"{name}.weight", entry, role, block_bytes=block_rows * row_bytes
            )
            whole = mx.quantize(to_mlx(np.ascontiguousarray(raw), "BF16"), group_size=64, bits=bits)
            # its error, measured block by block, is the whole tensor's
            x = to_mlx(np.ascontiguousarray(raw), "BF16").astype(mx.float32)
            w32 = [whole[0], whole[1].astype(mx.float32), whole[2].astype(mx.float32)]
            deq = mx.dequantize(*w32, group_size=64, bits=bits)  # in float32, as verify does
            want_err = (mx.abs(deq - x).sum() / mx.abs(x).sum()).item()
            err = got[f"{name}.weight"].pop("rel_l1")
            assert abs(err - want_err) <= 1e-5 * want_err, (name, bits, err, want_err)
            for suffix, arr in zip(("weight", "scales", "biases"), whole):
                want, dtype = from_mlx(arr)
                assert got[f"{name}.{suffix}"] == store.put_tensor(dtype, want), (
                    name,
                    bits,
                    suffix,
                )
                assert store.read_tensor(got[f"{name}.{suffix}"]).tobytes() == want.tobytes()
    assert not list((tmp_path / "cache" / "tmp").iterdir())  # every block's temp file renamed


def test_a_corrupt_object_read_in_blocks_is_removed_and_nothing_is_stored(tmp_path, capsys):
    """A store object whose bytes changed is found out by its digest as its blocks pass: the
    quantize fails with a store miss, the object is quarantined and no output is left behind."""
    from buildkit.quant.quantize import quantize_entry
    from buildkit.quant.roles import Role

    store = Store(tmp_path / "cache")
    entry = store.put_tensor("BF16", _bf16(np.random.default_rng(0), (8, 128)))
    path = store.object_path(entry["digest"])
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # in the last block
    path.write_bytes(bytes(data))
    before = {p for p in (tmp_path / "cache" / "objects").rglob("*") if p.is_file()}
    with pytest.raises(StoreMiss, match="corrupt"):
        quantize_entry(store, "w.weight", entry, Role(bits=8, group_size=64), block_bytes=2 * 256)
    after = {p for p in (tmp_path / "cache" / "objects").rglob("*") if p.is_file()}
    assert after == before - {path}
    assert not list((tmp_path / "cache" / "tmp").iterdir())
    assert "content does not match its digest" in capsys.readouterr().err
