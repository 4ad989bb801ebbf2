"""status for a variant with no build of its own: other variants' builds may have made its
nodes (xl's, by `make xl-mtp`), and status says so instead of "never built"."""

from __future__ import annotations

import json

from conftest import Project


def rows(p: Project) -> dict[str, dict]:
    return {r["variant"]: r for r in json.loads(p.run("status", "--json").stdout)}


def test_status_counts_nodes_another_variants_build_made(project, seed):
    project.adopt(seed)  # xl and xl-mtp built
    assert "forgot build xl" in project.run("forget", "xl").stdout
    xl = rows(project)["xl"]  # every node in the store (xl-mtp's build shares six) and fresh
    assert (xl["state"], xl["built"]) == ("fresh", False), xl
    assert xl["reason"] == "7 of 7 steps in the store, shared with xl-mtp"
    assert xl["built_by"] == ["xl-mtp"]
    text = project.run("status").stdout
    assert "never built" not in text.split("xl-mtp")[-1]  # the xl row: last, after xl-mtp's

    # as after `make xl-mtp` alone: xl's publish (its own inputs) is the one step to run
    project.run("gc")
    xl = rows(project)["xl"]
    assert xl["state"] == "stale", xl
    assert xl["reason"].startswith("publish: output missing from the store")
    assert xl["reason"].endswith("(6 of 7 steps in the store, shared with xl-mtp)")
    plan = project.run("plan", "xl").stdout
    assert "1 to run" in plan


def test_status_says_never_built_when_no_node_is_in_the_store(project):
    r = rows(project)
    assert all(v["state"] == "never built" and not v["built"] for v in r.values())
