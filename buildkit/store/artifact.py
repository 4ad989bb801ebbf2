"""The Artifact: a named tree of tensors and small files, addressed by the digest of its listing."""

from __future__ import annotations

from dataclasses import dataclass, field

from buildkit.core import keys
from buildkit.formats.tensors import nbytes


@dataclass
class Artifact:
    """A named tree of tensors and small files, addressed by the digest of its listing.

    ``tensors`` maps name -> {"dtype", "shape", "digest"} for store objects, or
    {"dtype", "shape", "view": {"file", "tensor", "slice"?}} for a byte range of
    an external source file (identified by content digest, never by path).
    ``files`` maps name -> blob digest. ``meta`` is free-form canonical JSON.
    """

    tensors: dict[str, dict] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    external: dict[str, str] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def listing(self) -> dict:
        return {
            "tensors": self.tensors,
            "files": self.files,
            "external": self.external,
            "meta": self.meta,
        }

    @property
    def digest(self) -> str:
        return keys.digest_json("artifact", self.listing())

    @classmethod
    def from_listing(cls, d: dict) -> Artifact:
        return cls(
            dict(d.get("tensors", {})),
            dict(d.get("files", {})),
            dict(d.get("external", {})),
            dict(d.get("meta", {})),
        )

    def tensor_bytes(self) -> int:
        return sum(nbytes(t["dtype"], t["shape"]) for t in self.tensors.values())


def objects(art: Artifact) -> dict[str, tuple[str, list[int]] | None]:
    """Every store object a listing needs: digest -> (dtype, shape) for a tensor stored alone
    (checked by its tensor digest), None for a blob: a small file, or a pack of tensors
    (``packs.py``; checked by its blob digest). Views name files outside the store."""
    out: dict[str, tuple[str, list[int]] | None] = {}
    for t in art.tensors.values():
        if "pack" in t:
            out[t["pack"]["file"]] = None
        elif "digest" in t:
            out[t["digest"]] = (t["dtype"], t["shape"])
    out.update(dict.fromkeys(art.files.values()))
    return out
