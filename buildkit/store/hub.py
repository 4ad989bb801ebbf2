"""The Hugging Face Hub: a snapshot checked against the Hub's own hashes, a folder uploaded,
and the Hub's errors said as what to do.

huggingface_hub checks a download's size, not its bytes. Its cache names every blob by the
ETag the Hub sent for it (an LFS file's sha256, a git blob's sha1), so ``verify_snapshot``
hashes each file of a snapshot and compares it with the name of the blob it links to: this
needs no network and holds whatever tool filled the cache. A file that does not match is
removed from the cache (a rerun downloads it again) and refused, named. A file once checked is
remembered under its stat in the store's memos, so a later plan does not read it again.
"""

from __future__ import annotations

import hashlib
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from buildkit.core import keys
from buildkit.core.errors import BuildkitError, SourceError, UsageError
from buildkit.store.fsio import stat_ident

PINNED = re.compile(r"^[0-9a-f]{40}$")
HASH_CHUNK = 8 << 20
HASH_THREADS = 4  # hashlib drops the GIL on large updates: files hash side by side
MEMO = "hub-verified"


def download(repo: str, rev: str, patterns: list[str], store, log=print) -> Path:
    """The snapshot directory of ``repo`` at ``rev`` (files matching ``patterns``), every file
    verified. A pinned commit already in the HF cache needs no network."""
    from huggingface_hub import snapshot_download

    source = f"hf://{repo}@{rev}"
    path = None
    if PINNED.match(rev):
        try:  # keeps no-op builds off the network; anything missing asks the Hub below
            path = Path(
                snapshot_download(
                    repo, revision=rev, allow_patterns=patterns, local_files_only=True
                )
            )
        except Exception:
            path = None
    if path is None:
        try:
            path = Path(snapshot_download(repo, revision=rev, allow_patterns=patterns))
        except Exception as e:  # hub errors come in many types: each says what to do
            raise explain(e, f"cannot fetch {source}", repo, rev) from e
    checked = verify_snapshot(path, store, source, repo, log)
    if checked:
        log(f"verified {checked} downloaded files of {source} against the Hub's sha256/etag")
    return path


def _hash(path: Path, algo: str) -> str:
    if algo == "sha256":
        h = hashlib.sha256()
    else:  # the git blob id of a file that is not in LFS
        h = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _expected(link: Path) -> tuple[Path, str, str] | None:
    """(blob, etag, algorithm) of a snapshot file, from the name of the blob it links to."""
    blob = link.resolve()
    if blob.parent.name != "blobs":
        return None
    etag = blob.name
    if re.fullmatch(r"[0-9a-f]{64}", etag):
        return blob, etag, "sha256"
    if re.fullmatch(r"[0-9a-f]{40}", etag):
        return blob, etag, "git-sha1"
    return None


def _from_tree(repo: str, commit: str, source: str) -> dict[str, tuple[str, str]]:
    """path -> (hash, algorithm) as the Hub's tree listing of ``commit`` gives them."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    try:
        entries = HfApi().list_repo_tree(repo, revision=commit, recursive=True)
        return {
            f.path: (f.lfs.sha256, "sha256") if f.lfs else (f.blob_id, "git-sha1")
            for f in entries
            if isinstance(f, RepoFile)
        }
    except Exception as e:
        raise explain(e, f"cannot check {source} against the Hub", repo, commit) from e


def verify_snapshot(root: Path, store, source: str, repo: str, log=print) -> int:
    """Check every file under ``root`` (an HF cache snapshot) against its blob's etag, or the
    Hub's tree listing for a file that is no blob link (a cache without symlinks); returns
    how many were hashed (not remembered from an earlier check). A mismatch is removed from
    the cache and raised as a SourceError naming the file."""
    from huggingface_hub import constants

    files = sorted(p for p in root.rglob("*") if p.is_file())
    expected = {p: _expected(p) for p in files}
    unnamed = [p for p, e in expected.items() if e is None]
    if unnamed and constants.HF_HUB_OFFLINE:
        log(
            f"warning: {len(unnamed)} files of {source} in {root} are not links to the HF "
            "cache's blobs and HF_HUB_OFFLINE is set: they are used unchecked"
        )
    elif unnamed:
        tree = _from_tree(repo, root.name, source)
        for p in unnamed:
            rel = p.relative_to(root).as_posix()
            if rel not in tree:
                raise SourceError(
                    f"{source}: {rel} is in {root} but not in the Hub's listing of that commit: "
                    "remove it from the HF cache and run the build again"
                )
            expected[p] = (p, *tree[rel])
    todo = []
    for p, e in expected.items():
        if e is None:
            continue
        blob, etag, algo = e
        key = keys.digest_json(MEMO, [str(blob), etag, stat_ident(blob.stat())])
        if store.get_memo(MEMO, key) is None:
            todo.append((p, blob, etag, algo, key))
    with ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="hub-hash") as ex:
        got = list(ex.map(lambda t: _hash(t[1], t[3]), todo))
    bad = [(t, g) for t, g in zip(todo, got) if g != t[2]]
    for (p, blob, *_), _g in bad:
        for f in (p, blob):
            f.unlink(missing_ok=True)
    if bad:
        (p, blob, etag, algo, _), g = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise SourceError(
            f"{source}: {p.relative_to(root)}{more}: its bytes do not match the Hub's {algo} "
            f"(the Hub's {etag}, downloaded {g}): the download was corrupted. It is removed from "
            "the HF cache; run the build again to download it again"
        )
    for p, _blob, etag, _algo, key in todo:
        store.put_memo(MEMO, key, {"path": str(p), "etag": etag})
    return len(todo)


def range_ref(path: Path) -> dict:
    """How a machine without this one's disk reads ``path`` by byte range: a file of an HF cache
    snapshot (``models--org--repo/snapshots/<commit>/<file>``) as the Hub's URL of that file at
    that commit, with its size and (an LFS file's) sha256; any other file as a ``file://`` URL,
    which only a machine that mounts it at the same path can read."""
    from huggingface_hub import hf_hub_url

    path = Path(path)
    parts = path.absolute().parts
    size = path.stat().st_size
    if "snapshots" in parts:
        i = len(parts) - 1 - parts[::-1].index("snapshots")
        repo_dir, commit, rel = parts[i - 1], parts[i + 1], "/".join(parts[i + 2 :])
        if repo_dir.startswith("models--") and PINNED.match(commit) and rel:
            repo = repo_dir.removeprefix("models--").replace("--", "/")
            e = _expected(path)
            return {
                "url": hf_hub_url(repo, rel, revision=commit),
                "size": size,
                "sha256": e[1] if e and e[2] == "sha256" else None,
                "hub": True,
            }
    return {"url": path.absolute().as_uri(), "size": size}


def upload(folder: Path, repo_id: str, message: str) -> str:
    """Create ``repo_id`` if needed and upload ``folder`` to it (dot-files, such as publish's
    stamp, stay home); returns the commit's URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo_id, exist_ok=True)
        info = api.upload_folder(
            repo_id=repo_id, folder_path=folder, ignore_patterns=[".*"], commit_message=message
        )
    except Exception as e:
        raise explain(e, f"cannot push {folder} to {repo_id}", repo_id, write=True) from e
    return str(info)


def _is_connection_error(e: BaseException) -> bool:
    names = {c.__name__ for c in type(e).__mro__}
    net = {  # httpx's (huggingface_hub 1.x+) and requests' (older) names for a broken link
        "ConnectError",
        "ConnectionError",
        "NetworkError",
        "RemoteProtocolError",
        "Timeout",
        "TimeoutException",
    }
    return bool(names & net) or isinstance(e, ConnectionError | TimeoutError)


def explain(
    e: BaseException, what: str, repo: str, rev: str | None = None, write: bool = False
) -> BuildkitError:
    """A Hub failure as an error that says what to do: a token, a gated repo's terms, a wrong
    name or revision, the network."""
    from huggingface_hub import constants
    from huggingface_hub import errors as hf

    GatedRepoError, HfHubHTTPError = hf.GatedRepoError, hf.HfHubHTTPError
    RepositoryNotFoundError, RevisionNotFoundError = (
        hf.RepositoryNotFoundError,
        hf.RevisionNotFoundError,
    )
    LocalEntryNotFoundError = hf.LocalEntryNotFoundError
    # before 1.0 a missing remote file was an EntryNotFoundError
    RemoteEntryNotFoundError = getattr(hf, "RemoteEntryNotFoundError", hf.EntryNotFoundError)

    endpoint = constants.ENDPOINT.rstrip("/")
    page = f"{endpoint}/{repo}"
    response = getattr(e, "response", None)
    status = getattr(response, "status_code", None)
    said = f" ({status})" if status else ""
    token = "HF_TOKEN is set" if os.environ.get("HF_TOKEN") else "no HF_TOKEN is set"
    if isinstance(e, GatedRepoError):
        return SourceError(
            f"{what}: {repo} is a gated repository these credentials may not read{said}, "
            f"{token}: accept the terms at {page} with your Hugging Face account, then set "
            "HF_TOKEN to a token of that account (or run `hf auth login`)"
        )
    if isinstance(e, RevisionNotFoundError):
        return UsageError(
            f"{what}: {repo} has no revision {rev!r}{said}: pass a commit sha, branch or tag "
            f"that it has (see {page}/commits/main)"
        )
    if isinstance(e, RemoteEntryNotFoundError):
        return SourceError(f"{what}: a file is missing from {repo} at {rev!r}{said}: {e}")
    if isinstance(e, RepositoryNotFoundError):
        return UsageError(
            f"{what}: no repository {repo} at {endpoint}, or it is private{said}: check the "
            f"name (hf://org/name@revision); for a private repository set HF_TOKEN to a token "
            f"that can read it ({token})"
        )
    if isinstance(e, HfHubHTTPError) and status in (401, 403):
        need = "write to" if write else "read"
        return SourceError(
            f"{what}: the Hub refused the credentials{said}, {token}: set HF_TOKEN to a token "
            f"that may {need} {repo} (create one at {endpoint}/settings/tokens)"
        )
    if isinstance(e, HfHubHTTPError):
        return SourceError(f"{what}: the Hub answered{said}: {e}; try again later")
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in (
        "1",
        "true",
        "yes",
        "on",
    ):
        return SourceError(
            f"{what}: {e}. HF_HUB_OFFLINE is set and this revision is not in the local HF cache: "
            "download it on a machine online (or unset HF_HUB_OFFLINE), or pass --source with a "
            "local directory"
        )
    chain, c = [], e
    while c is not None:
        chain.append(c)
        c = c.__cause__ or c.__context__
    if any(_is_connection_error(c) for c in chain) or isinstance(e, LocalEntryNotFoundError):
        return SourceError(
            f"{what}: lost the connection to {endpoint} ({type(chain[-1]).__name__}: "
            f"{chain[-1]}): check the network and run the build again (files downloaded whole "
            "stay in the HF cache and are not fetched twice). Offline? Set HF_HUB_OFFLINE=1 to "
            "use the local HF cache, or pass --source with a local directory"
        )
    return SourceError(f"{what}: {type(e).__name__}: {e}")
