"""The package's shape: no function longer than a screen (60 lines) unless the allow-list below
says why in a line."""

from __future__ import annotations

import ast
from pathlib import Path

import buildkit

MAX_LINES = 60

# module:function (methods as Class.method) -> why it may be longer than MAX_LINES
ALLOWED = {
    "buildkit.fixtures.generated:generate": "a linear script: plan, shards, index, side files",
    "buildkit.fixtures.generated:FixtureSpec._check": "one check per field, each its own message",
    "buildkit.store.hub:explain": "one branch per Hub failure a user meets, each with its advice",
}


def long_functions(root: Path, limit: int = MAX_LINES) -> dict[str, int]:
    """``module:function`` -> its length in lines (decorators excluded) for every function under
    ``root`` longer than ``limit``, nested ones and methods included."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        mod = ".".join((root.name, *path.relative_to(root).with_suffix("").parts))
        mod = mod.removesuffix(".__init__")
        stack = [(node, "") for node in ast.parse(path.read_text(), str(path)).body]
        while stack:
            node, prefix = stack.pop()
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + node.name
                if node.end_lineno - node.lineno + 1 > limit:
                    found[f"{mod}:{name}"] = node.end_lineno - node.lineno + 1
                prefix = name + "."
            elif isinstance(node, ast.ClassDef):
                prefix = prefix + node.name + "."
            stack += [(child, prefix) for child in ast.iter_child_nodes(node)]
    return found


def test_no_function_is_longer_than_a_screen():
    long = long_functions(Path(buildkit.__file__).parent)
    over = {k: n for k, n in long.items() if k not in ALLOWED}
    assert over == {}, (
        f"functions over {MAX_LINES} lines: {over}; split them, or add each to ALLOWED in "
        "tests/test_shape.py with a one-line reason"
    )
    stale = sorted(set(ALLOWED) - set(long))
    assert stale == [], f"{stale} are {MAX_LINES} lines or less now: remove them from ALLOWED"


def test_the_check_catches_a_long_function_and_a_long_method(tmp_path):
    pkg = tmp_path / "buildkit"
    (pkg / "engine").mkdir(parents=True)
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))
    (pkg / "engine" / "plan.py").write_text(
        f"def short():\n    return 1\n\n\ndef long():\n{body}\n\n"
        f"class Plan:\n    def run(self):\n{body.replace('    ', '        ')}"
        f"        def inner():\n{body.replace('    ', '            ')}"
    )
    assert long_functions(pkg) == {
        "buildkit.engine.plan:long": MAX_LINES + 1,
        "buildkit.engine.plan:Plan.run": 2 * MAX_LINES + 2,
        "buildkit.engine.plan:Plan.run.inner": MAX_LINES + 1,
    }
    assert long_functions(pkg, limit=MAX_LINES + 1) == {
        "buildkit.engine.plan:Plan.run": 2 * MAX_LINES + 2
    }
