"""Canonical JSON and xxh3-128 digests.

Every digest names its algorithm (``xxh3_128:<32 hex>``) and every hashed value
is tagged with what it is, so a tensor and a file with equal bytes never share
a digest and a change of hashing scheme is visible in the digest itself.
"""

from __future__ import annotations

import json
from typing import Any

import xxhash

ALGO = "xxh3_128"
PREFIX = ALGO + ":"


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8, no NaN: the same value gives the same bytes anywhere."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def _hex(h: xxhash.xxh3_128) -> str:
    return PREFIX + h.hexdigest()


def digest_json(tag: str, value: Any) -> str:
    """Digest of a tagged JSON value: ``xxh3_128(tag NUL canonical_json(value))``."""
    h = xxhash.xxh3_128()
    h.update(tag.encode() + b"\0")
    h.update(canonical_json(value))
    return _hex(h)


def tensor_hasher(dtype: str, shape: list[int] | tuple[int, ...]) -> xxhash.xxh3_128:
    """A running hasher for a tensor's bytes, seeded with its dtype and shape."""
    h = xxhash.xxh3_128()
    h.update(b"tensor\0" + canonical_json([dtype, list(shape)]) + b"\0")
    return h


def tensor_digest(dtype: str, shape: list[int] | tuple[int, ...], data: bytes | memoryview) -> str:
    h = tensor_hasher(dtype, shape)
    h.update(data)
    return _hex(h)


def blob_hasher() -> xxhash.xxh3_128:
    h = xxhash.xxh3_128()
    h.update(b"blob\0")
    return h


def blob_digest(data: bytes | memoryview) -> str:
    h = blob_hasher()
    h.update(data)
    return _hex(h)


def finish(h: xxhash.xxh3_128) -> str:
    return _hex(h)


def short(digest: str, n: int = 12) -> str:
    return digest.removeprefix(PREFIX)[:n]


def is_digest(value: str) -> bool:
    if not isinstance(value, str) or not value.startswith(PREFIX):
        return False
    hexpart = value[len(PREFIX) :]
    return len(hexpart) == 32 and all(c in "0123456789abcdef" for c in hexpart)
