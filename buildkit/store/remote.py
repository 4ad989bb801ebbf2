"""The remote cache: action records, listings and objects shared through a bucket or a shared disk.

``--remote URL`` (or ``BUILDKIT_REMOTE``) on build, plan, explain, status and verify:
``s3://bucket/prefix`` on any S3-compatible server (endpoint and credentials from the
standard AWS environment: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``AWS_PROFILE``), or ``file:///shared/dir``. The key layout is the local store's::

    objects/ab/<hex>    tensor and file bytes      (as the local store)
    artifacts/ab/<hex>  artifact listings          (as the local store)
    actions/ab/<hex>    signed envelopes of action records (below)

**Reading** (``Remote.lookup``, through ``plan.Planner.lookup``): a local miss fetches the
record and its output listings; objects come later and only when a node that will run needs
them as inputs (``Remote.materialize``, through ``Planner.fetch_inputs``). Each object streams
into a temp file in the store's ``tmp/`` (``fsio.DirectFile``), hashed as it comes (xxh3 and
sha256), and is renamed into place only if both match: a corrupt or truncated remote object,
or a record that fails its checks, is a miss with a warning naming it and is never served.
A remote that stops answering is switched off for the rest of the process with a warning,
and the build goes on locally.

**Writing** (``--remote-upload``, ``buildkit push``): per node, objects first (each re-hashed
from the local store, so a corrupt local object is never sent; those the remote has are
skipped), then listings, the record last: a record never names an object the remote lacks.
A node whose record the remote already holds is skipped whole (a second upload sends
nothing); one refused in this process (corrupt) is sent again, overwriting.

**Trust.** xxh3 is fast but not collision-resistant, so every envelope carries the sha256 of
each listing and object it names, and of itself; downloads check both digests. With
``BUILDKIT_SIGNING_KEY`` (path to an ed25519 private key, PEM or raw) records are signed;
a reader with ``BUILDKIT_TRUSTED_KEYS`` (comma-separated: public keys as PEM files, files of
base64 keys, or base64 keys) refuses any record not signed by one of them. What this stops:
a writer to the bucket without a trusted key cannot get a reader to use bytes of its choice
(it cannot sign a record, and cannot swap an object or listing under a signed record without
breaking its sha256); accidental corruption and truncation in transit or at rest. What it
does not stop: a holder of a trusted key (e.g. a compromised CI) can sign any outputs for any
key: the key maps inputs to outputs and nobody re-checks the step's work; deletion and
replay (an old validly signed record for the same key is still valid; deleting records only
causes rebuilds); and without trusted keys, any writer can publish a self-consistent record.

Views into source files (sanitize's renamed or sliced tensors) are not objects: neither
remote nor local stores hold them, and a build needs the source files locally (fetch's key
holds their digests), exactly as without a remote.

**gc.** ``buildkit gc`` never touches the remote unless given ``--remote URL`` explicitly
(``BUILDKIT_REMOTE`` is not enough). Other machines' roots are unknown here, so it never
judges a record by local roots: it removes records older than ``--remote-max-age DAYS`` if
asked, then listings and objects that no remaining record names and that are older than
``GC_GRACE`` (an upload in progress writes objects before its record).

boto3 rather than obstore: its managed transfer gives multipart uploads, concurrent ranged
downloads that still reach the writer in order (so hashing as bytes arrive works), and
retries; botocore reads the standard AWS environment and profiles; and a real S3 server for
tests (moto's) speaks to it. obstore would be faster per request but adds a Rust wheel and
would need its own in-order, verify-as-you-go download path.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from buildkit.core import keys
from buildkit.core.errors import BuildkitError, StoreMiss, UsageError
from buildkit.formats.tensors import nbytes
from buildkit.store.artifact import Artifact, objects
from buildkit.store.fsio import DirectFile, atomic_write
from buildkit.store.layout import fan, fan_key
from buildkit.store.store import Store

FORMAT = 1
CHUNK = 8 << 20
THREADS = 8  # objects moved at once (I/O bound: the network, not the cores)
GC_GRACE = 24 * 3600  # seconds an unnamed remote object is left alone (an upload may be under way)
SIG_TAG = b"buildkit-remote-record\0"


class RemoteError(BuildkitError):
    """The remote cache cannot be used (unreachable, refused, misconfigured)."""


class Absent(Exception):
    """The remote has no such entry."""


# ---- backends: bytes at keys ---------------------------------------------------------


@dataclass
class Traffic:
    puts: int = 0
    bytes_up: int = 0
    gets: int = 0
    bytes_down: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)


class Backend:
    """Bytes at keys (``objects/ab/hex``...): the two remotes differ only here."""

    url: str
    traffic: Traffic

    def head(self, key: str) -> bool: ...
    def get(self, key: str) -> bytes: ...  # raises Absent
    def download(
        self, key: str, sink, size: int | None = None
    ) -> None: ...  # sink.write(chunk) in order; Absent
    def put(self, key: str, data: bytes) -> None: ...
    def upload(self, key: str, path: Path) -> None: ...
    def list(self, prefix: str) -> Iterator[tuple[str, float]]: ...  # (key, mtime)
    def delete(self, keys_: list[str]) -> None: ...
    def size(self, key: str) -> int: ...  # raises Absent
    def get_range(self, key: str, start: int, end: int) -> tuple[bytes, int]: ...  # (bytes, size)


class FileBackend(Backend):
    """A directory on a shared disk; writes are temp file + rename (``fsio``), as the store's."""

    def __init__(self, url: str, root: Path):
        self.url, self.root, self.traffic = url, root, Traffic()
        self.tmp = root / "tmp"

    def head(self, key: str) -> bool:
        return (self.root / key).is_file()

    def get(self, key: str) -> bytes:
        try:
            data = (self.root / key).read_bytes()
        except FileNotFoundError:
            raise Absent(key) from None
        self.traffic.add(gets=1, bytes_down=len(data))
        return data

    def download(self, key: str, sink, size: int | None = None) -> None:
        try:
            f = open(self.root / key, "rb")
        except FileNotFoundError:
            raise Absent(key) from None
        self.traffic.add(gets=1)
        with f:
            while chunk := f.read(CHUNK):
                self.traffic.add(bytes_down=len(chunk))
                sink.write(chunk)

    def put(self, key: str, data: bytes) -> None:
        atomic_write(self.root / key, data, self.tmp)
        self.traffic.add(puts=1, bytes_up=len(data))

    def upload(self, key: str, path: Path) -> None:
        def chunks():
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK):
                    yield chunk

        size = atomic_write(self.root / key, chunks(), self.tmp)
        self.traffic.add(puts=1, bytes_up=size)

    def list(self, prefix: str) -> Iterator[tuple[str, float]]:
        base = self.root / prefix
        for p in sorted(base.glob("*/*")) if base.is_dir() else []:
            with contextlib.suppress(FileNotFoundError):
                yield str(p.relative_to(self.root)), p.stat().st_mtime

    def delete(self, keys_: list[str]) -> None:
        for k in keys_:
            (self.root / k).unlink(missing_ok=True)

    def size(self, key: str) -> int:
        try:
            return (self.root / key).stat().st_size
        except FileNotFoundError:
            raise Absent(key) from None

    def get_range(self, key: str, start: int, end: int) -> tuple[bytes, int]:
        try:
            with open(self.root / key, "rb") as f:
                f.seek(start)
                data = f.read(end - start)
                size = os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            raise Absent(key) from None
        self.traffic.add(gets=1, bytes_down=len(data))
        return data, size


class S3Backend(Backend):
    """An S3 bucket and prefix through boto3 (managed transfers: multipart, concurrent parts)."""

    def __init__(self, url: str, bucket: str, prefix: str):
        try:
            import boto3
            from boto3.s3.transfer import TransferConfig
            from botocore.config import Config
        except ImportError:
            raise UsageError(
                f"remote {url}: s3:// needs boto3; pip install 'buildkit[remote]'"
            ) from None

        self.url, self.bucket, self.prefix, self.traffic = url, bucket, prefix.strip("/"), Traffic()
        # Short timeouts and few retries: a cache that does not answer is worth less than a rebuild.
        cfg = Config(
            connect_timeout=5,
            read_timeout=60,
            retries={"max_attempts": 3, "mode": "standard"},
            max_pool_connections=THREADS * 2,
        )
        self.client = boto3.session.Session().client("s3", config=cfg)
        self.transfer = TransferConfig(
            multipart_threshold=64 << 20,
            multipart_chunksize=16 << 20,
            max_concurrency=4,
            io_chunksize=1 << 20,
            num_download_attempts=2,
        )

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    @staticmethod
    def _absent(e) -> bool:
        return e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound")

    def head(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._k(key))
            return True
        except ClientError as e:
            if self._absent(e):
                return False
            raise

    def get(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        try:
            data = self.client.get_object(Bucket=self.bucket, Key=self._k(key))["Body"].read()
        except ClientError as e:
            if self._absent(e):
                raise Absent(key) from None
            raise
        self.traffic.add(gets=1, bytes_down=len(data))
        return data

    def download(self, key: str, sink, size: int | None = None) -> None:
        from botocore.exceptions import ClientError

        counted = _Counted(sink, self.traffic)
        try:
            if size is None or size < self.transfer.multipart_threshold:
                # One GET: the managed transfer would HEAD first to learn the size. A blob's size
                # is unknown here, but blobs are small files (fetch keeps big ones as views).
                body = self.client.get_object(Bucket=self.bucket, Key=self._k(key))["Body"]
                for chunk in body.iter_chunks(1 << 20):
                    counted.write(chunk)
            else:  # a sink without seek/tell is non-seekable: parts come together, written in order
                self.client.download_fileobj(
                    self.bucket, self._k(key), counted, Config=self.transfer
                )
        except ClientError as e:
            if self._absent(e):
                raise Absent(key) from None
            raise
        self.traffic.add(gets=1)

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._k(key), Body=data)
        self.traffic.add(puts=1, bytes_up=len(data))

    def upload(self, key: str, path: Path) -> None:
        self.client.upload_file(str(path), self.bucket, self._k(key), Config=self.transfer)
        self.traffic.add(puts=1, bytes_up=path.stat().st_size)

    def list(self, prefix: str) -> Iterator[tuple[str, float]]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._k(prefix) + "/"
        )
        for page in pages:
            for o in page.get("Contents", []):
                yield (
                    o["Key"][len(self.prefix) + 1 if self.prefix else 0 :],
                    o["LastModified"].timestamp(),
                )

    def size(self, key: str) -> int:
        from botocore.exceptions import ClientError

        try:
            return self.client.head_object(Bucket=self.bucket, Key=self._k(key))["ContentLength"]
        except ClientError as e:
            if self._absent(e):
                raise Absent(key) from None
            raise

    def get_range(self, key: str, start: int, end: int) -> tuple[bytes, int]:
        from botocore.exceptions import ClientError

        try:
            r = self.client.get_object(
                Bucket=self.bucket, Key=self._k(key), Range=f"bytes={start}-{end - 1}"
            )
        except ClientError as e:
            if self._absent(e):
                raise Absent(key) from None
            raise
        data = r["Body"].read()
        self.traffic.add(gets=1, bytes_down=len(data))
        return data, int(r["ContentRange"].rsplit("/", 1)[1])

    def delete(self, keys_: list[str]) -> None:
        for i in range(0, len(keys_), 1000):
            batch = [{"Key": self._k(k)} for k in keys_[i : i + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})


class _Counted:
    def __init__(self, sink, traffic: Traffic):
        self.sink, self.traffic = sink, traffic

    def write(self, data) -> int:
        self.traffic.add(bytes_down=len(data))
        return self.sink.write(data)


def backend(url: str) -> Backend:
    u = urlparse(url)
    if u.scheme == "file":
        root = Path(unquote(u.path))
        root.mkdir(parents=True, exist_ok=True)
        return FileBackend(url, root)
    if u.scheme == "s3":
        if not u.netloc:
            raise UsageError(f"remote {url!r}: expected s3://bucket/prefix")
        return S3Backend(url, u.netloc, u.path)
    raise UsageError(f"remote {url!r}: expected s3://bucket/prefix or file:///shared/dir")


def _fan(kind: str, digest: str) -> str:
    return f"{kind}/{fan_key(digest)}"


def object_key(digest: str) -> str:
    """Where an object lies in a remote (``objects/ab/<hex>``)."""
    return _fan("objects", digest)


def _digest_of(key: str) -> str:
    parts = key.split("/")
    return keys.PREFIX + parts[-2] + parts[-1]


# ---- keys: signing and trust ---------------------------------------------------------


def _need_cryptography() -> None:
    try:
        import cryptography  # noqa: F401
    except ImportError:
        raise UsageError(
            "signed records need cryptography; pip install 'buildkit[remote]'"
        ) from None


def _load_private(path: str):
    _need_cryptography()
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise UsageError(f"BUILDKIT_SIGNING_KEY: cannot read {path}: {e.strerror}") from None
    with contextlib.suppress(ValueError, TypeError):
        k = serialization.load_pem_private_key(data, password=None)
        if isinstance(k, Ed25519PrivateKey):
            return k
    with contextlib.suppress(ValueError):
        return Ed25519PrivateKey.from_private_bytes(base64.b64decode(data.strip(), validate=True))
    raise UsageError(
        f"BUILDKIT_SIGNING_KEY: {path} is not an ed25519 private key (PEM, or 32 bytes base64)"
    )


def public_key_text(key) -> str:
    """A public key as ``BUILDKIT_TRUSTED_KEYS`` takes it: base64 of its 32 raw bytes."""
    from cryptography.hazmat.primitives import serialization

    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def _load_trusted(spec: str) -> dict[str, object]:
    _need_cryptography()
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    out: dict[str, object] = {}

    def add_text(t: str, where: str) -> None:
        try:
            k = Ed25519PublicKey.from_public_bytes(base64.b64decode(t, validate=True))
        except ValueError:
            raise UsageError(
                f"BUILDKIT_TRUSTED_KEYS: {where}: not an ed25519 public key (base64 of 32 bytes)"
            ) from None
        out[public_key_text(k)] = k

    for item in filter(None, (s.strip() for s in spec.split(","))):
        p = Path(item).expanduser()
        if not p.is_file():
            add_text(item, repr(item))
            continue
        data = p.read_bytes()
        if b"-----BEGIN" in data:
            k = serialization.load_pem_public_key(data)
            if not isinstance(k, Ed25519PublicKey):
                raise UsageError(f"BUILDKIT_TRUSTED_KEYS: {p} is not an ed25519 public key")
            out[public_key_text(k)] = k
        else:
            for line in data.decode().split():
                add_text(line, str(p))
    return out


# ---- the remote cache ----------------------------------------------------------------


class _Sink:
    """Where a download streams: a temp file, hashed (xxh3 and sha256) as bytes arrive."""

    def __init__(self, f: DirectFile, xxh):
        self.f, self.xxh, self.sha, self.size = f, xxh, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.xxh.update(data)
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)


class Remote:
    """A remote cache: lookups that fill the local store, and uploads from it."""

    def __init__(
        self,
        be: Backend,
        signing_key=None,
        trusted: dict | None = None,
        log: Callable[[str], None] | None = None,
    ):
        self.be, self.url = be, be.url
        self.signing_key, self.trusted = signing_key, trusted
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.sha: dict[str, str] = {}  # digest -> sha256 hex, from the envelopes read
        self.refused: set[str] = set()  # object digests and record keys found bad here
        self.off: str | None = None  # why the remote was switched off, once it failed
        self._lock = threading.Lock()
        self._inflight: dict[str, threading.Lock] = {}  # one download per object at a time

    @classmethod
    def open(cls, url: str, quiet: bool = False) -> Remote:
        """A remote from a URL, with the signing key and trusted keys of the environment."""
        key = os.environ.get("BUILDKIT_SIGNING_KEY")
        trusted = os.environ.get("BUILDKIT_TRUSTED_KEYS")
        return cls(
            backend(url),
            _load_private(key) if key else None,
            _load_trusted(trusted) if trusted else None,
            (lambda msg: None) if quiet else None,
        )

    def _warn(self, msg: str) -> None:
        print(f"buildkit: warning: {msg}", file=sys.stderr, flush=True)

    def _fail(self, e: Exception) -> None:
        """The remote stopped answering: off for the rest of this process, the build goes on
        locally."""
        with self._lock:
            first, self.off = self.off is None, f"{type(e).__name__}: {e}"
        if first:
            self._warn(f"remote {self.url} failed ({self.off}); going on without it")

    def _where(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}"

    # -- records

    def _signable(self, body: dict) -> bytes:
        return SIG_TAG + keys.canonical_json(body)

    def _envelope(self, body: dict) -> bytes:
        env = {
            "body": body,
            "sha256": hashlib.sha256(keys.canonical_json(body)).hexdigest(),
            "signature": None,
        }
        if self.signing_key is not None:
            sig = self.signing_key.sign(self._signable(body))
            env["signature"] = {
                "key": public_key_text(self.signing_key.public_key()),
                "ed25519": base64.b64encode(sig).decode(),
            }
        return keys.canonical_json(env)

    def _check_envelope(self, key: str, data: bytes) -> tuple[dict | None, str]:
        """The record body if the envelope is whole, for this key and trusted; else why not."""
        try:
            env = json.loads(data)
            body = env["body"]
            ok = env["sha256"] == hashlib.sha256(keys.canonical_json(body)).hexdigest()
        except (ValueError, KeyError, TypeError):
            return None, "not a record (truncated or corrupt)"
        if not ok:
            return None, "content does not match its sha256 (corrupt)"
        if not (
            isinstance(body, dict)
            and isinstance(body.get("listings"), dict)
            and isinstance(body.get("objects"), dict)
        ):
            return None, "not a record (malformed)"
        rec = body.get("record")
        if (
            body.get("format") != FORMAT
            or body.get("key") != key
            or not isinstance(rec, dict)
            or rec.get("key") != key
            or not isinstance(rec.get("outputs"), dict)
            or not all(map(keys.is_digest, rec["outputs"].values()))
        ):
            return None, "not the record of this key"
        if self.trusted is not None:
            sig = env.get("signature") if isinstance(env.get("signature"), dict) else {}
            pub = self.trusted.get(sig.get("key", ""))
            if not sig:
                return None, "unsigned, and trusted keys are set"
            if pub is None:
                return None, f"signed by an untrusted key {sig.get('key', '')[:12]}..."
            from cryptography.exceptions import InvalidSignature

            try:
                pub.verify(base64.b64decode(sig.get("ed25519", "")), self._signable(body))
            except (InvalidSignature, ValueError):
                return None, "signature does not verify"
        return body, ""

    def lookup(self, store: Store, key: str) -> dict | None:
        """The action record of ``key`` from the remote, its listings put in the local store
        (objects are fetched later, by ``materialize``); None on a miss or a refused record."""
        if self.off is not None or key in self.refused:
            return None
        where = _fan("actions", key)
        try:
            data = self.be.get(where)
        except Absent:
            return None
        except Exception as e:  # botocore raises many kinds; any of them means "not from here"
            self._fail(e)
            return None
        body, why = self._check_envelope(key, data)
        if body is not None:
            named = {**body.get("listings", {}), **body.get("objects", {})}
            bad = sorted(d for d in named if d in self.refused)
            if bad:
                body, why = None, f"names object {keys.short(bad[0])}, which was corrupt"
        if body is None:
            self.refused.add(key)
            self._warn(f"remote record {self._where(where)} refused: {why}; the node is rebuilt")
            return None
        rec = body["record"]
        try:
            for d in rec["outputs"].values():
                self._fetch_listing(store, d, body)
        except _Refused as e:
            self.refused.add(key)
            self._warn(f"remote record {self._where(where)} refused: {e}; the node is rebuilt")
            return None
        except Exception as e:
            self._fail(e)
            return None
        with self._lock:
            self.sha.update(body["listings"])
            self.sha.update(body["objects"])
        store.put_action(key, rec)  # complete once its objects are (Store.get_action checks)
        return {**rec, "remote": self.url}

    def _fetch_listing(self, store: Store, digest: str, body: dict) -> None:
        want = body.get("listings", {}).get(digest)
        if want is None:
            raise _Refused(f"it names listing {keys.short(digest)} without its sha256")
        if not fan(store.layout.artifacts, digest).exists():
            try:
                data = self.be.get(_fan("artifacts", digest))
            except Absent:
                raise _Refused(
                    f"its listing {self._where(_fan('artifacts', digest))} is missing"
                ) from None
            try:
                art = Artifact.from_listing(json.loads(data))
                ok = hashlib.sha256(data).hexdigest() == want and art.digest == digest
            except (ValueError, AttributeError):
                ok = False
            if not ok:
                self.refused.add(digest)
                raise _Refused(f"its listing {self._where(_fan('artifacts', digest))} is corrupt")
            store.put_artifact(art)
        art = store.get_artifact(digest)
        for d in objects(art):
            if d not in body.get("objects", {}):
                raise _Refused(f"it names object {keys.short(d)} without its sha256")

    # -- objects

    def materialize(self, store: Store, artifacts: Iterable[str], label: str = "") -> None:
        """Bring the objects of these (local) listings into the local store from the remote,
        each checked as it streams in; a corrupt one raises StoreMiss (the build runs again
        and its producer, whose record now names a refused object, is rebuilt)."""
        if self.off is not None:
            return
        todo: dict[str, tuple | None] = {}
        for a in dict.fromkeys(artifacts):
            art = store.get_artifact(a)
            for d, shape in objects(art).items():
                if not store.has_object(d):
                    todo[d] = shape
        todo = {
            d: s for d, s in todo.items() if d in self.sha
        }  # unknown here: the store's miss as usual
        if not todo:
            return
        t0, before = time.monotonic(), self.be.traffic.bytes_down
        try:
            with ThreadPoolExecutor(min(THREADS, len(todo)), thread_name_prefix="remote-get") as ex:
                list(ex.map(lambda kv: self._get_object(store, *kv), todo.items()))
        except StoreMiss:
            raise
        except Exception as e:
            self._fail(e)
            raise StoreMiss(f"remote {self.url} failed while downloading") from e
        store.sync_objects()
        got = self.be.traffic.bytes_down - before
        dt = max(time.monotonic() - t0, 1e-6)
        self.log(
            f"[remote] {label or 'download'}: {len(todo)} objects, {got / 1e6:.1f} MB in {dt:.2f}s "
            f"({got / 1e6 / dt:.1f} MB/s) from {self.url}"
        )

    def _get_object(self, store: Store, digest: str, shape) -> None:
        with self._lock:
            lock = self._inflight.setdefault(digest, threading.Lock())
        with lock:  # two nodes that need the same object (publish ahead of verify) fetch it once
            if digest in self.refused:
                raise StoreMiss(f"remote object {keys.short(digest)} was corrupt")
            if not store.has_object(digest):
                self._download(store, digest, shape)

    def _download(self, store: Store, digest: str, shape) -> None:
        if self.off is not None:  # another download found the remote gone
            raise StoreMiss(f"remote {self.url} failed")
        where = _fan("objects", digest)
        xxh = keys.tensor_hasher(*shape) if shape else keys.blob_hasher()
        tmp = (
            store.layout.tmp
            / f".remote.{os.getpid()}.{threading.get_ident()}.{time.monotonic_ns()}.tmp"
        )
        try:
            with DirectFile(tmp, direct=False, sync=False) as f:
                sink = _Sink(f, xxh)
                try:
                    self.be.download(where, sink, nbytes(*shape) if shape else None)
                except Absent:
                    sink = None
            why = (
                "missing"
                if sink is None
                else "truncated"
                if shape and sink.size != nbytes(*shape)
                else "content does not match its digest"
                if keys.finish(xxh) != digest
                else "content does not match its sha256"
                if sink.sha.hexdigest() != self.sha[digest]
                else None
            )
            if why:
                self.refused.add(digest)
                self._warn(
                    f"remote object {self._where(where)} refused: {why}; "
                    "the node that made it is rebuilt"
                )
                raise StoreMiss(f"remote object {keys.short(digest)} was {why}")
            dest = store.object_path(digest)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, dest)
            store.stats.add(written=sink.size, objects=1)
            store.mark_unsynced()
        finally:
            tmp.unlink(missing_ok=True)

    # -- upload

    def push(self, store: Store, nodes: Iterable[tuple[str, str, dict[str, str]]]) -> dict:
        """Upload nodes (name, key, outputs) the remote lacks: objects, listings, record last."""
        sent = {"nodes": 0, "objects": 0, "listings": 0, "bytes": 0, "skipped": 0}
        if self.off is not None:
            raise RemoteError(
                f"remote {self.url} failed earlier in this run ({self.off}); nothing uploaded"
            )
        for name, key, outputs in nodes:
            t0, up0, puts0 = time.monotonic(), self.be.traffic.bytes_up, self.be.traffic.puts
            try:
                n = self._push_node(store, key, outputs)
            except (OSError, BuildkitError):
                raise
            except Exception as e:
                raise RemoteError(
                    f"upload to {self.url} failed at node {name}: {type(e).__name__}: {e}"
                ) from e
            if n is None:
                sent["skipped"] += 1
                continue
            sent["nodes"] += 1
            sent["objects"] += n[0]
            sent["listings"] += n[1]
            up = self.be.traffic.bytes_up - up0
            sent["bytes"] += up
            dt = max(time.monotonic() - t0, 1e-6)
            self.log(
                f"[upload] {name}: {n[0]} objects, {n[1]} listings, "
                f"{self.be.traffic.puts - puts0} puts, "
                f"{up / 1e6:.1f} MB in {dt:.2f}s ({up / 1e6 / dt:.1f} MB/s) to {self.url}"
            )
        return sent

    def _push_node(self, store: Store, key: str, outputs: dict[str, str]) -> tuple[int, int] | None:
        arts = {d: store.get_artifact(d) for d in outputs.values()}
        objs: dict[str, tuple | None] = {}
        for art in arts.values():
            objs.update(objects(art))
        repair = self.refused.intersection([key, *arts, *objs])  # found corrupt here: send again
        if not repair and self.be.head(_fan("actions", key)):
            return None
        with ThreadPoolExecutor(
            max(1, min(THREADS, len(objs))), thread_name_prefix="remote-put"
        ) as ex:
            results = list(ex.map(lambda kv: self._put_object(store, *kv), objs.items()))
        shas = {d: s for d, s, _ in results}
        listings = {}
        sent_listings = 0
        for d in arts:
            data = fan(store.layout.artifacts, d).read_bytes()
            listings[d] = hashlib.sha256(data).hexdigest()
            if d in self.refused or not self.be.head(_fan("artifacts", d)):
                self.be.put(_fan("artifacts", d), data)
                sent_listings += 1
        rec = store.get_action(key)
        if rec is None:
            raise StoreMiss(
                f"the record of {keys.short(key)} is not complete in the local store; build first"
            )
        body = {"format": FORMAT, "key": key, "record": rec, "listings": listings, "objects": shas}
        self.be.put(_fan("actions", key), self._envelope(body))
        self.refused.discard(key)
        return sum(sent for _, _, sent in results), sent_listings

    def _put_object(self, store: Store, digest: str, shape) -> tuple[str, str, bool]:
        """Re-hash a local object (never send a corrupt one), then send it unless the remote
        has it."""
        path = store.object_path(digest)
        xxh = keys.tensor_hasher(*shape) if shape else keys.blob_hasher()
        sha = hashlib.sha256()
        try:
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK):
                    xxh.update(chunk)
                    sha.update(chunk)
        except FileNotFoundError:
            raise StoreMiss(
                f"store object {keys.short(digest)} is missing locally; "
                "build again before uploading"
            ) from None
        if keys.finish(xxh) != digest:
            store.quarantine(path, "content does not match its digest")
            raise StoreMiss(
                f"store object {keys.short(digest)} was corrupt and has been removed; build again"
            )
        where = _fan("objects", digest)
        if digest not in self.refused and self.be.head(where):
            return digest, sha.hexdigest(), False
        self.be.upload(where, path)
        self.refused.discard(digest)
        return digest, sha.hexdigest(), True

    # -- a detached Dask build's side (``store/detached.py`` is the workers')

    def ensure_objects(self, store: Store, objs: dict[str, tuple | None]) -> int:
        """Upload the local objects the remote lacks (a HEAD each first, as FindMissingBlobs:
        never re-upload what it has); how many were sent."""
        if self.off is not None:
            raise RemoteError(f"remote {self.url} failed earlier in this run ({self.off})")
        with ThreadPoolExecutor(max(1, min(THREADS, len(objs))), "remote-put") as ex:
            sent = list(ex.map(lambda kv: self._put_object(store, *kv)[2], objs.items()))
        return sum(sent)

    def missing(self, digests: list[str]) -> set[str]:
        """The objects the remote lacks (a HEAD each)."""
        with ThreadPoolExecutor(max(1, min(THREADS, len(digests))), "remote-head") as ex:
            have = list(ex.map(lambda d: self.be.head(_fan("objects", d)), digests))
        return {d for d, h in zip(digests, have) if not h}

    def get_into(self, digest: str, dtype: str, shape, path: str, offset: int) -> None:
        """A worker's output object, checked against its digest, into a pack at ``offset``."""
        want = nbytes(dtype, shape)
        h = keys.tensor_hasher(dtype, shape)
        fd = os.open(path, os.O_WRONLY)

        class Sink:
            done = 0

            def write(self, data) -> int:
                if Sink.done + len(data) > want:
                    raise StoreMiss(f"remote object {keys.short(digest)} is longer than its shape")
                h.update(data)
                os.pwrite(fd, data, offset + Sink.done)
                Sink.done += len(data)
                return len(data)

        try:
            self.be.download(_fan("objects", digest), Sink(), want)
        except Absent:
            raise StoreMiss(
                f"remote {self.url} lost object {keys.short(digest)}; rebuild"
            ) from None
        finally:
            os.close(fd)
        if Sink.done != want or keys.finish(h) != digest:
            self.be.delete([_fan("objects", digest)])
            raise StoreMiss(
                f"remote object {self._where(_fan('objects', digest))} is corrupt (its bytes do "
                "not match its digest): removed; the node is rebuilt"
            )

    # -- gc

    def gc(self, dry_run: bool, max_age_days: float | None) -> dict:
        """Records older than ``max_age_days`` (if given), then listings and objects that no
        remaining record names and that are older than ``GC_GRACE``."""
        now = time.time()
        removed = {"actions": 0, "artifacts": 0, "objects": 0}
        named: set[str] = set()
        doomed: list[str] = []
        for k, mtime in self.be.list("actions"):
            if max_age_days is not None and now - mtime > max_age_days * 86400:
                doomed.append(k)
                removed["actions"] += 1
                continue
            with contextlib.suppress(Absent, ValueError, KeyError, TypeError):
                body = json.loads(self.be.get(k))["body"]
                named.update(body["listings"])
                named.update(body["objects"])
        if not dry_run:
            self.be.delete(doomed)  # records first: none may name what goes next
        for kind in ("artifacts", "objects"):
            gone = [
                k
                for k, mtime in self.be.list(kind)
                if _digest_of(k) not in named and now - mtime > GC_GRACE
            ]
            removed[kind] = len(gone)
            if not dry_run:
                self.be.delete(gone)
        return removed


class _Refused(Exception):
    pass


# ---- whole variants: push and pull ---------------------------------------------------


def closure(sched, where: str) -> list:
    """Every node of the planned variant with its key and outputs, or an error naming those
    that have none ``where``."""
    states = sched.plan()
    missing = [s.name for s in states if not s.key or not s.outputs]
    if missing:
        raise RemoteError(f"{sched.m.name}: no complete record of {', '.join(missing)} {where}")
    return states


def push_variant(sched, remote: Remote) -> dict:
    """Upload a built variant's closure: every node's record, listings and objects (views into
    source files are not objects and stay local, like the source itself)."""
    states = closure(sched, "in the local store; build it (or pull it) first")
    return remote.push(sched.store, [(s.name, s.key, s.outputs) for s in states])


def pull_variant(sched, remote: Remote) -> list:
    """Download a variant's closure from the remote into the local store and remember it as a
    build root (so gc keeps it); a failure of the remote is an error here, not a rebuild."""
    states = closure(sched, f"here or on {remote.url}; build and push it first")
    if remote.off is not None:
        raise RemoteError(f"pull from {remote.url} failed: {remote.off}")
    for s in states:
        try:
            remote.materialize(sched.store, s.outputs.values(), label=s.name)
        except StoreMiss as e:
            raise RemoteError(
                f"pull from {remote.url} failed at node {s.name}: {remote.off or e}"
            ) from e
    for s in states:
        if sched.store.get_action(s.key) is None:
            raise RemoteError(
                f"pull from {remote.url}: node {s.name} is not complete (see the warnings above)"
            )
    sched.record({s.name: s for s in states})
    return states
