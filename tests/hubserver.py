"""A Hugging Face Hub on 127.0.0.1 for tests: the endpoints huggingface_hub calls for
``snapshot_download``, ``get_safetensors_metadata``, ``create_repo`` and ``upload_folder``.

Built on the stdlib's ``ThreadingHTTPServer`` rather than werkzeug/flask: the faults the tests
need (a body cut after N bytes, a server that goes away mid-file) are a socket closed by hand,
and each response header (ETag, X-Linked-Etag, X-Linked-Size, X-Repo-Commit, Content-Range,
X-Error-Code) is written exactly as the Hub writes it.

Plain LFS only: no ``X-Xet-Hash`` header and no ``xetHash`` in tree entries, so downloads take
huggingface_hub's HTTP path. Uploads need ``HF_HUB_DISABLE_XET=1`` in the client's environment,
since huggingface_hub uploads through Xet whenever hf_xet is installed, without asking the server.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import socket
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_MIN_SIZE = 10 << 20  # the Hub's default: larger files go to LFS whatever their name


@dataclass(frozen=True)
class Blob:
    data: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def git_sha1(self) -> str:
        return hashlib.sha1(b"blob %d\0" % len(self.data) + self.data).hexdigest()

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_sha1


def is_lfs(path: str, data: bytes) -> bool:
    return path.endswith(".safetensors") or len(data) >= LFS_MIN_SIZE or b"\0" in data[:1024]


@dataclass
class Repo:
    repo_id: str
    gated: bool = False
    private: bool = False
    commits: dict[str, dict[str, Blob]] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)

    def resolve(self, rev: str) -> str | None:
        if rev in self.branches:
            return self.branches[rev]
        return rev if rev in self.commits else None


@dataclass
class Fault:
    after: int  # body bytes sent before the connection is closed
    gone: bool = False  # and then the server stops answering
    corrupt: bool = False  # or: serve the whole body with one byte changed


class HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


class Hub:
    """An in-memory Hub. ``token``: the token that may write and read gated repos it accepted."""

    def __init__(self, token: str = "hf_test_token"):
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}
        self.accepted: set[str] = set()  # gated repos whose terms the token's user accepted
        self.faults: dict[str, Fault] = {}  # repo file path -> the next GET's fault (once)
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        self.served: Counter[str] = Counter()  # body bytes sent, by repo file path
        self.gone = False
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    # ---- content -------------------------------------------------------------------

    def create(self, repo_id: str, gated: bool = False, private: bool = False) -> Repo:
        self.repos[repo_id] = Repo(repo_id, gated=gated, private=private)
        return self.repos[repo_id]

    def commit(self, repo_id: str, files: dict[str, bytes], branch: str = "main") -> str:
        """A new commit on ``branch`` with ``files`` added or replaced; returns its sha."""
        repo = self.repos.get(repo_id) or self.create(repo_id)
        parent = repo.branches.get(branch)
        tree = dict(repo.commits.get(parent, {}))
        tree.update({p: Blob(d, is_lfs(p, d)) for p, d in files.items()})
        h = hashlib.sha1(f"{parent}".encode())
        for p in sorted(tree):
            h.update(f"{p}\0{tree[p].etag}\n".encode())
        sha = h.hexdigest()
        repo.commits[sha] = tree
        repo.branches[branch] = sha
        return sha

    def upload_dir(self, repo_id: str, folder: Path, **kw) -> str:
        files = {
            p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        }
        if repo_id not in self.repos:
            self.create(repo_id, **kw)
        return self.commit(repo_id, files)

    def files(self, repo_id: str, rev: str = "main") -> dict[str, Blob]:
        repo = self.repos[repo_id]
        return repo.commits[repo.resolve(rev)]

    # ---- faults --------------------------------------------------------------------

    def drop_after(self, path: str, n: int) -> None:
        """The next GET of ``path`` closes the connection after ``n`` bytes of its body."""
        self.faults[path] = Fault(n)

    def gone_after(self, path: str, n: int) -> None:
        """The next GET of ``path`` sends ``n`` bytes, then the whole server stops answering."""
        self.faults[path] = Fault(n, gone=True)

    def corrupt(self, path: str) -> None:
        """The next GET of ``path`` sends bytes that do not match its sha256 (one flipped)."""
        self.faults[path] = Fault(0, corrupt=True)

    # ---- the server ----------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> Hub:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = _Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self.gone = True
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def env(self, home: Path) -> dict[str, str]:
        """What a client process needs to talk to this Hub, with a fresh cache under ``home``."""
        return {
            "HF_ENDPOINT": self.url,
            "HF_HOME": str(home),
            "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_OFFLINE": "0",
        }


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client gone is a test's fault
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: Hub

    def log_message(self, *args) -> None:  # quiet: tests read hub.requests
        pass

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    # ---- plumbing ------------------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        hub = self.hub
        if hub.gone:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self._read = False
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.split("/")[1:]]
        with hub._lock:
            hub.requests.append((method, url.path, self.headers.get("Range")))
        try:
            self._route(method, parts, parse_qs(url.query))
        except HubError as e:
            if method in ("POST", "PUT") and not self._read:
                self._body()  # the next request on this connection starts after it
            headers = {"X-Error-Message": e.message}
            if e.code:
                headers["X-Error-Code"] = e.code
            if e.commit:
                headers["X-Repo-Commit"] = e.commit
            body = json.dumps({"error": e.message}).encode()
            headers["Content-Type"] = "application/json"
            self._send(e.status, body, headers, head=method == "HEAD")

    def _body(self) -> bytes:
        self._read = True
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, body: bytes, headers: dict[str, str], head: bool = False) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, status: int, obj, headers: dict[str, str] | None = None) -> None:
        self._send(
            status,
            json.dumps(obj).encode(),
            {"Content-Type": "application/json", **(headers or {})},
        )

    def _token(self) -> str | None:
        auth = self.headers.get("authorization") or ""
        return auth[len("Bearer ") :] if auth.startswith("Bearer ") else None

    def _repo(self, repo_id: str, write: bool = False) -> Repo:
        """The repo, or the error the Hub gives this request's credentials."""
        hub, token = self.hub, self._token()
        if token is not None and token != hub.token:
            raise HubError(401, None, "Invalid credentials in Authorization header")
        repo = hub.repos.get(repo_id)
        if repo is None or (repo.private and token is None):  # the Hub does not tell them apart
            raise HubError(404 if token else 401, "RepoNotFound", "Repository not found")
        if write and token is None:
            raise HubError(401, None, "You must be authenticated to write")
        if repo.gated and token is None:
            raise HubError(
                401,
                "GatedRepo",
                f"Access to model {repo_id} is restricted. You must have access to it and be "
                "authenticated to access it. Please log in.",
            )
        if repo.gated and repo_id not in hub.accepted:
            raise HubError(
                403,
                "GatedRepo",
                f"Access to model {repo_id} is restricted and you are not in the authorized list. "
                f"Visit {self._base()}/{repo_id} to ask for access.",
            )
        return repo

    def _commit(self, repo: Repo, rev: str) -> str:
        sha = repo.resolve(rev)
        if sha is None:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return sha

    def _base(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    # ---- routes --------------------------------------------------------------------

    def _route(self, method: str, p: list[str], query: dict) -> None:
        if p[:2] == ["api", "repos"] and p[2:] == ["create"] and method == "POST":
            return self._create_repo()
        if p[:2] == ["api", "validate-yaml"] and method == "POST":
            self._body()
            return self._json(200, {"errors": [], "warnings": []})
        if p[:2] == ["api", "models"] and len(p) >= 4:
            repo_id, rest = f"{p[2]}/{p[3]}", p[4:]
            if method == "GET" and rest[:1] in ([], ["revision"]):
                return self._repo_info(repo_id, rest[1] if len(rest) > 1 else "main")
            if method == "GET" and rest[:1] == ["tree"]:
                recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
                return self._tree(repo_id, rest[1], "/".join(rest[2:]), recursive)
            if method == "POST" and rest[:1] == ["preupload"]:
                return self._preupload(repo_id, rest[1])
            if method == "POST" and rest[:1] == ["commit"]:
                return self._commit_route(repo_id, rest[1])
        if len(p) >= 5 and p[2] == "resolve" and method in ("GET", "HEAD"):
            return self._resolve(method, f"{p[0]}/{p[1]}", p[3], "/".join(p[4:]))
        if len(p) == 6 and p[1].endswith(".git") and p[5] == "batch" and method == "POST":
            return self._lfs_batch(f"{p[0]}/{p[1][: -len('.git')]}")
        if p[:1] == ["lfs-upload"] and method == "PUT":
            return self._lfs_put(p[1])
        if p[:1] == ["lfs-verify"] and method == "POST":
            oid = json.loads(self._body())["oid"]
            if oid not in self.hub.lfs_objects:
                raise HubError(404, None, f"LFS object {oid} was not uploaded")
            return self._json(200, {"ok": True})
        raise HubError(404, None, f"no route for {method} /{'/'.join(p)}")

    def _repo_info(self, repo_id: str, rev: str) -> None:
        repo = self._repo(repo_id)
        sha = self._commit(repo, rev)
        tree = repo.commits[sha]
        self._json(
            200,
            {
                "id": repo_id,
                "modelId": repo_id,
                "sha": sha,
                "private": repo.private,
                "gated": "manual" if repo.gated else False,
                "siblings": [{"rfilename": p} for p in sorted(tree)],
                "tags": [],
            },
        )

    def _tree(self, repo_id: str, rev: str, prefix: str, recursive: bool) -> None:
        repo = self._repo(repo_id)
        tree = repo.commits[self._commit(repo, rev)]
        base = f"{prefix}/" if prefix else ""
        entries, dirs = [], set()
        for path in sorted(tree):
            if not path.startswith(base):
                continue
            rest = path[len(base) :].split("/")
            for i in range(1, len(rest)):
                dirs.add(base + "/".join(rest[:i]))
            if len(rest) > 1 and not recursive:
                continue
            b = tree[path]
            entry = {"type": "file", "oid": b.git_sha1, "size": len(b.data), "path": path}
            if b.lfs:
                entry["lfs"] = {"oid": b.sha256, "size": len(b.data), "pointerSize": 134}
            entries.append(entry)
        if not recursive:
            dirs = {d for d in dirs if "/" not in d[len(base) :]}
        folders = [
            {"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
            for d in sorted(dirs)
        ]
        self._json(200, folders + entries)

    def _resolve(self, method: str, repo_id: str, rev: str, path: str) -> None:
        hub = self.hub
        repo = self._repo(repo_id)
        sha = self._commit(repo, rev)
        blob = repo.commits[sha].get(path)
        if blob is None:
            raise HubError(404, "EntryNotFound", f"{path} does not exist on {rev}", commit=sha)
        data, total = blob.data, len(blob.data)
        headers = {
            "X-Repo-Commit": sha,
            "ETag": f'"{blob.etag}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if blob.lfs:
            headers["X-Linked-Etag"] = f'"{blob.sha256}"'
            headers["X-Linked-Size"] = str(total)
        status, start, end = 200, 0, total - 1
        rng = self.headers.get("Range")
        if rng:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if m is None:
                raise HubError(416, None, f"bad Range {rng!r}")
            start = int(m[1])
            end = min(int(m[2]), total - 1) if m[2] else total - 1
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{total}"
        body = data[start : end + 1]
        if method == "HEAD":
            return self._send(status, body, headers, head=True)
        fault = hub.faults.pop(path, None)
        if fault is not None and fault.corrupt:
            body = bytes([body[0] ^ 0xFF]) + body[1:]
        elif fault is not None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: fault.after])
            self.wfile.flush()
            with hub._lock:
                hub.served[path] += fault.after
            if fault.gone:
                hub.gone = True
                threading.Thread(target=hub.stop, daemon=True).start()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        with hub._lock:
            hub.served[path] += len(body)
        self._send(status, body, headers)

    def _create_repo(self) -> None:
        hub = self.hub
        payload = json.loads(self._body())
        token = self._token()
        if token != hub.token:
            raise HubError(401, None, "Invalid credentials in Authorization header")
        repo_id = f"{payload['organization']}/{payload['name']}"
        url = f"{self._base()}/{repo_id}"
        if repo_id in hub.repos:
            raise HubError(409, None, "You already created this model repo")
        hub.create(repo_id, private=bool(payload.get("private")))
        hub.commit(
            repo_id, {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"}
        )
        self._json(200, {"url": url, "name": repo_id})

    def _preupload(self, repo_id: str, rev: str) -> None:
        repo = self._repo(repo_id, write=True)
        tree = repo.commits.get(repo.resolve(rev) or "", {})
        files = []
        for f in json.loads(self._body())["files"]:
            sample = base64.b64decode(f["sample"])
            lfs = f["path"].endswith(".safetensors") or f["size"] >= LFS_MIN_SIZE or b"\0" in sample
            old = tree.get(f["path"])
            files.append(
                {
                    "path": f["path"],
                    "uploadMode": "lfs" if lfs else "regular",
                    "shouldIgnore": False,
                    "oid": old.etag if old else None,
                }
            )
        self._json(200, {"files": files})

    def _lfs_batch(self, repo_id: str) -> None:
        self._repo(repo_id, write=True)
        req = json.loads(self._body())
        objects = []
        for o in req["objects"]:
            entry = {"oid": o["oid"], "size": o["size"], "authenticated": True}
            if o["oid"] not in self.hub.lfs_objects:
                entry["actions"] = {
                    "upload": {"href": f"{self._base()}/lfs-upload/{o['oid']}"},
                    "verify": {"href": f"{self._base()}/lfs-verify"},
                }
            objects.append(entry)
        self._json(200, {"transfer": "basic", "objects": objects})

    def _lfs_put(self, oid: str) -> None:
        data = self._body()
        if hashlib.sha256(data).hexdigest() != oid:
            raise HubError(400, None, f"uploaded bytes do not hash to {oid}")
        self.hub.lfs_objects[oid] = data
        self._send(200, b"", {})

    def _commit_route(self, repo_id: str, rev: str) -> None:
        hub = self.hub
        self._repo(repo_id, write=True)
        files: dict[str, bytes] = {}
        summary = ""
        for line in self._body().splitlines():
            item = json.loads(line)
            v = item["value"]
            if item["key"] == "header":
                summary = v["summary"]
            elif item["key"] == "file":
                files[v["path"]] = base64.b64decode(v["content"])
            elif item["key"] == "lfsFile":
                if v["oid"] not in hub.lfs_objects:
                    raise HubError(422, None, f"{v['path']}: LFS object {v['oid']} not uploaded")
                files[v["path"]] = hub.lfs_objects[v["oid"]]
            else:
                raise HubError(400, None, f"commit operation {item['key']!r} is not served here")
        sha = hub.commit(repo_id, files, branch=rev)
        self._json(
            200,
            {
                "commitUrl": f"{self._base()}/{repo_id}/commit/{sha}",
                "commitOid": sha,
                "commitMessage": summary,
                "pullRequestUrl": None,
            },
        )
