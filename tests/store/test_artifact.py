"""The Artifact: its listing, its digest (pinned), and its tensor bytes."""

from __future__ import annotations

from buildkit.core import keys
from buildkit.store.artifact import Artifact

D = "xxh3_128:" + "ab" * 16


def test_digest_is_of_the_canonical_listing_and_pinned():
    art = Artifact(
        tensors={"w": {"dtype": "BF16", "shape": [2, 3], "digest": D}},
        files={"config.json": D},
        meta={"k": 1},
    )
    assert art.listing() == {
        "tensors": art.tensors,
        "files": art.files,
        "external": {},
        "meta": {"k": 1},
    }
    assert art.digest == keys.digest_json("artifact", art.listing())
    assert Artifact().digest == "xxh3_128:d88a0ca0f4c61f2ad9315760d38b6f47"
    assert art.digest == "xxh3_128:6462cb50649ec72dfaa424a18c7bc600"
    same = Artifact(
        meta={"k": 1},
        files={"config.json": D},
        tensors={"w": {"shape": [2, 3], "digest": D, "dtype": "BF16"}},
    )
    assert same.digest == art.digest  # dict order is not part of it
    for other in (
        Artifact(art.tensors, art.files, meta={"k": 2}),
        Artifact(art.tensors, {}, meta={"k": 1}),
        Artifact(art.tensors, art.files, {"f": D}, {"k": 1}),
    ):
        assert other.digest != art.digest


def test_from_listing_round_trips_and_copies():
    art = Artifact(
        tensors={"w": {"dtype": "F32", "shape": [4], "view": {"file": D, "tensor": "w"}}},
        external={"f": D},
    )
    listing = art.listing()
    back = Artifact.from_listing(listing)
    assert back == art and back.digest == art.digest
    listing["tensors"]["x"] = {}
    assert "x" not in back.tensors  # a copy, not the caller's dicts
    assert Artifact.from_listing({}) == Artifact()


def test_tensor_bytes_sums_stored_and_viewed_tensors():
    art = Artifact(
        tensors={
            "a": {"dtype": "BF16", "shape": [3, 4], "digest": D},
            "b": {
                "dtype": "U32",
                "shape": [5],
                "view": {"file": D, "tensor": "b", "slice": [0, 0, 5]},
            },
            "c": {"dtype": "F32", "shape": [0, 9], "digest": D},
        }
    )
    assert art.tensor_bytes() == 24 + 20 + 0
    assert Artifact().tensor_bytes() == 0
