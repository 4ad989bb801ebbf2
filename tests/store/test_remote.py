"""The remote cache against a real S3 server (moto's, on 127.0.0.1) and a file:// remote.

One project builds xl and uploads it once per module; each test copies that upload into a
bucket or directory of its own, so it may corrupt it, and builds in new, empty projects.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest
from conftest import XL, Project, cached, in_build_order, ran
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from s3server import CREDS, moto_s3
from s3server import s3_client as client


@pytest.fixture(scope="module")
def server():
    with moto_s3() as endpoint:
        yield endpoint


@pytest.fixture
def aws(server, monkeypatch):
    for k, v in {**CREDS, "AWS_ENDPOINT_URL": server}.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "BUILDKIT_REMOTE", "BUILDKIT_SIGNING_KEY", "BUILDKIT_TRUSTED_KEYS"):
        monkeypatch.delenv(k, raising=False)
    return server


@pytest.fixture(scope="module")
def uploaded(server, tmp_path_factory):
    """xl built once with --remote-upload into bucket ``base`` (prefix ci) and pushed to a file
    remote."""
    mp = pytest.MonkeyPatch()
    for k, v in {**CREDS, "AWS_ENDPOINT_URL": server}.items():
        mp.setenv(k, v)
    try:
        client(server).create_bucket(Bucket="base")
        a = Project(tmp_path_factory.mktemp("writer"))
        p = a.build("xl", "--remote", "s3://base/ci", "--remote-upload")
        assert "sent 7 nodes" in p.stderr, p.stderr
        files = tmp_path_factory.mktemp("fileremote") / "base"
        a.run("push", "xl", "--out", str(a.out / "xl"), "--remote", files.as_uri())
        yield a, files
    finally:
        mp.undo()


def bucket_from_base(endpoint: str) -> str:
    name = "b" + uuid.uuid4().hex[:12]
    c = client(endpoint)
    c.create_bucket(Bucket=name)
    for page in c.get_paginator("list_objects_v2").paginate(Bucket="base"):
        for o in page.get("Contents", []):
            c.copy_object(Bucket=name, Key=o["Key"], CopySource={"Bucket": "base", "Key": o["Key"]})
    return name


def listing(endpoint: str, bucket: str) -> dict[str, tuple]:
    c = client(endpoint)
    return {
        o["Key"]: (o["ETag"], o["LastModified"], o["Size"])
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for o in page.get("Contents", [])
    }


def tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def stray(store: Path) -> list[str]:
    """Files in the store that are not whole entries: temp files anywhere but tmp/."""
    return [
        str(p)
        for p in store.rglob("*")
        if p.is_file() and "tmp" in p.name and p.parent.name != "tmp"
    ]


def test_empty_store_builds_from_s3_and_second_upload_sends_nothing(aws, uploaded, tmp_path):
    writer, _ = uploaded
    bucket = bucket_from_base(aws)
    url = f"s3://{bucket}/ci"
    before = listing(aws, bucket)
    p = writer.build("xl", "--remote", url, "--remote-upload")
    assert "sent 0 nodes" in p.stderr and "7 nodes already there" in p.stderr, p.stderr
    assert listing(aws, bucket) == before  # not one PUT: keys, etags and times unchanged

    b = Project(tmp_path / "reader")
    p = b.build("xl", "--remote", url)
    # Every computing step is a remote hit; publish writes the directory (its only side effect).
    assert ran(p) == ["publish"], p.stderr
    assert sorted(cached(p)) == ["eval", "fetch", "quantize", "reference", "sanitize", "verify"]
    assert p.stderr.count("(remote)") == 6
    assert tree(b.out / "xl") == tree(writer.out / "xl")
    # Planning fetches records and listings only; objects come when a node that runs needs them.
    c = Project(tmp_path / "planner")
    p = c.run("plan", "xl", "--out", str(c.out / "xl"), "--remote", url)
    assert p.stdout.count("fresh") == 6 and "stale publish" in p.stdout, p.stdout
    assert not [q for q in (c.store / "objects").rglob("*") if q.is_file()]
    assert b.run("store", "check").returncode == 0
    assert not stray(b.store)


def test_corrupt_remote_object_and_record_are_refused_and_rebuilt(aws, uploaded, tmp_path):
    writer, _ = uploaded
    bucket = bucket_from_base(aws)
    c = client(aws)
    ref = json.loads((writer.store / "refs" / "xl.json").read_text())["nodes"]
    # One object publish needs (a quantized weight) and verify's record.
    qart = json.loads(
        c.get_object(Bucket=bucket, Key="ci/actions/" + _fan(ref["quantize"]["key"]))["Body"].read()
    )
    listing_digest = qart["body"]["record"]["outputs"]["out"]
    tensors = json.loads((writer.store / "artifacts" / _fan(listing_digest)).read_bytes())[
        "tensors"
    ]
    obj = next(  # the pack that holds it
        t["pack"]["file"]
        for n, t in sorted(tensors.items())
        if n.endswith("switch_mlp.up_proj.weight")
    )
    obj_key = "ci/objects/" + _fan(obj)
    data = bytearray(c.get_object(Bucket=bucket, Key=obj_key)["Body"].read())
    data[len(data) // 2] ^= 0xFF
    c.put_object(Bucket=bucket, Key=obj_key, Body=bytes(data))
    # And a file sanitize's output names but quantize's does not (one fetch made): refused,
    # so fetch is rebuilt too.
    sart = json.loads(
        (writer.store / "artifacts" / _fan(ref["sanitize"]["outputs"]["model"])).read_bytes()
    )
    qart_files = json.loads((writer.store / "artifacts" / _fan(listing_digest)).read_bytes())[
        "files"
    ]
    sobj = sorted(set(sart["files"].values()) - set(qart_files.values()))[0]
    c.put_object(Bucket=bucket, Key="ci/objects/" + _fan(sobj), Body=b"")
    rec_key = "ci/actions/" + _fan(ref["verify"]["key"])
    rec = c.get_object(Bucket=bucket, Key=rec_key)["Body"].read()
    c.put_object(Bucket=bucket, Key=rec_key, Body=rec[: len(rec) // 2])  # truncated

    b = Project(tmp_path / "reader")
    p = b.build("xl", "--remote", f"s3://{bucket}/ci", "--remote-upload")
    assert (
        f"remote object s3://{bucket}/ci/objects/{_fan(obj)} refused: "
        "content does not match its digest" in p.stderr
    )
    assert (
        f"remote record s3://{bucket}/ci/actions/{_fan(ref['verify']['key'])} refused: not a record"
        in p.stderr
    )
    assert (
        f"remote object s3://{bucket}/ci/objects/{_fan(sobj)} refused: "
        "content does not match its digest" in p.stderr
    )
    assert {"fetch", "quantize", "verify", "publish"} <= set(ran(p)), p.stderr
    # verify reads both (quantize's pack, and sanitize's file through its listing): both are
    # refused in one round, and one round of rebuilding restores them
    assert p.stderr.count("building again to restore it") == 1
    assert tree(b.out / "xl") == tree(writer.out / "xl")
    assert b.run("store", "check").returncode == 0
    # The reader's upload repaired both: the next empty store takes everything from the remote.
    c2 = Project(tmp_path / "third")
    p = c2.build("xl", "--remote", f"s3://{bucket}/ci")
    assert ran(p) == ["publish"] and "refused" not in p.stderr, p.stderr


def _fan(digest: str) -> str:
    h = digest.split(":", 1)[1]
    return f"{h[:2]}/{h[2:]}"


def _keypair(d: Path, name: str) -> tuple[Path, str]:
    k = ed25519.Ed25519PrivateKey.generate()
    path = d / f"{name}.pem"
    path.write_bytes(
        k.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    raw = k.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return path, base64.b64encode(raw).decode()


def test_trusted_keys_refuse_unsigned_and_wrongly_signed_records(uploaded, tmp_path, monkeypatch):
    writer, _ = uploaded
    ci_key, ci_pub = _keypair(tmp_path, "ci")
    _, other_pub = _keypair(tmp_path, "other")
    signed = tmp_path / "signed"
    monkeypatch.setenv("BUILDKIT_SIGNING_KEY", str(ci_key))
    writer.run("push", "xl", "--out", str(writer.out / "xl"), "--remote", signed.as_uri())
    monkeypatch.delenv("BUILDKIT_SIGNING_KEY")
    unsigned = uploaded[1]  # pushed without a key

    pubfile = tmp_path / "trusted.pub"
    pubfile.write_text(ci_pub + "\n")
    monkeypatch.setenv("BUILDKIT_TRUSTED_KEYS", f"{other_pub},{pubfile}")
    p = Project(tmp_path / "ok").build("xl", "--remote", signed.as_uri())
    assert ran(p) == ["publish"] and "refused" not in p.stderr, p.stderr

    p = Project(tmp_path / "unsigned").build("xl", "--remote", unsigned.as_uri())
    assert p.stderr.count("refused: unsigned, and trusted keys are set") == 7, p.stderr
    assert in_build_order(ran(p), XL), p.stderr

    # A valid signature moved onto other content: the envelope's sha256 is made to match.
    rec_path = (
        signed
        / "actions"
        / _fan(
            json.loads((writer.store / "refs" / "xl.json").read_text())["nodes"]["quantize"]["key"]
        )
    )
    env = json.loads(rec_path.read_bytes())
    env["body"]["record"]["stats"]["seconds"] = 0.5
    import hashlib

    from buildkit.core.keys import canonical_json

    env["sha256"] = hashlib.sha256(canonical_json(env["body"])).hexdigest()
    rec_path.write_bytes(canonical_json(env))
    p = Project(tmp_path / "forged").build("xl", "--remote", signed.as_uri())
    assert (
        f"remote record {signed.as_uri()}/actions/{_fan(env['body']['key'])} refused: "
        "signature does not verify" in p.stderr
    )
    assert "quantize" in ran(p)

    monkeypatch.setenv("BUILDKIT_TRUSTED_KEYS", other_pub)
    p = Project(tmp_path / "untrusted").build("xl", "--remote", signed.as_uri())
    assert "refused: signed by an untrusted key" in p.stderr
    assert in_build_order(ran(p), XL), p.stderr


class CutProxy:
    """A TCP proxy to the S3 server that goes away for good once ``limit`` response bytes have
    passed: connections are cut mid-response and no new ones are accepted."""

    def __init__(self, upstream: str, limit: int):
        self.up = ("127.0.0.1", int(upstream.rsplit(":", 1)[1]))
        self.limit, self.sent, self.dead = limit, 0, threading.Event()
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.lsock.getsockname()[1]}"
        self.socks: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.dead.is_set():
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            u = socket.create_connection(self.up)
            self.socks += [c, u]
            threading.Thread(target=self._pump, args=(c, u, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c, True), daemon=True).start()

    def _pump(self, src, dst, counted):
        try:
            while data := src.recv(65536):
                if counted:
                    with self.lock:
                        room = self.limit - self.sent
                        self.sent += len(data)
                    if room <= len(data):
                        dst.sendall(data[: max(room, 0)])
                        self.kill()
                        return
                dst.sendall(data)
        except OSError:
            pass

    def kill(self):
        self.dead.set()
        for s in [self.lsock, *self.socks]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def test_server_gone_mid_pull_is_a_clear_error_and_a_build_goes_on_locally(
    aws, uploaded, tmp_path, monkeypatch
):
    writer, _ = uploaded
    bucket = bucket_from_base(aws)
    url = f"s3://{bucket}/ci"
    # Records and listings are a few KB; the cut falls in the objects.
    proxy = CutProxy(aws, limit=400_000)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    b = Project(tmp_path / "reader")
    p = b.run("pull", "xl", "--out", str(b.out / "xl"), "--remote", url, check=False)
    assert proxy.dead.is_set()
    assert p.returncode == 1 and f"pull from {url} failed" in p.stderr, p.stderr
    print(p.stderr)
    assert not stray(b.store)
    assert b.run("store", "check").returncode == 0

    p = b.build("xl", "--remote", url)  # the server is still gone: warned, built here
    assert f"remote {url} failed" in p.stderr and "going on without it" in p.stderr, p.stderr
    # Nodes whose objects all arrived before the cut are local hits now; the rest ran here.
    assert "quantize" in ran(p) and sorted(ran(p) + cached(p)) == sorted(XL), p.stderr
    assert tree(b.out / "xl") == tree(writer.out / "xl")
    assert b.run("store", "check").returncode == 0
    assert not stray(b.store)


def test_push_pull_file_remote_then_build_offline(uploaded, tmp_path, monkeypatch):
    writer, files = uploaded
    remote = tmp_path / "shared"
    shutil.copytree(files, remote)
    monkeypatch.setenv("BUILDKIT_REMOTE", remote.as_uri())
    b = Project(tmp_path / "reader")
    p = b.run("pull", "xl", "--out", str(b.out / "xl"))
    assert "pulled 7 nodes" in p.stderr
    monkeypatch.delenv("BUILDKIT_REMOTE")
    p = b.build("xl")
    assert ran(p) == ["publish"], p.stderr  # everything was pulled: no remote needed
    assert tree(b.out / "xl") == tree(writer.out / "xl")
    # gc keeps the pulled build; gc --remote removes nothing fresh (a day's grace).
    b.run("gc")
    assert ran(b.build("xl")) == []
    p = b.run("gc", "--remote", remote.as_uri())
    assert "freed 0 records, 0 listings, 0 objects" in p.stdout
    assert tree(remote) == tree(files)
    # Two days on, an object no record names (an upload that died before its record) goes;
    # everything a record names stays.
    stray_obj = remote / "objects" / "ff" / ("0" * 30)
    stray_obj.parent.mkdir(exist_ok=True)
    stray_obj.write_bytes(b"left by an interrupted upload")
    for q in remote.rglob("*"):
        os.utime(q, (time.time() - 2 * 86400,) * 2)
    p = b.run("gc", "--remote", remote.as_uri())
    assert "freed 0 records, 0 listings, 1 objects" in p.stdout
    assert not stray_obj.exists() and tree(remote) == tree(files)
