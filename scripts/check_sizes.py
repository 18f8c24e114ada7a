#!/usr/bin/env python3
"""List Python files over 500 lines and functions over 50 lines in megatron_zeppelin/ and scripts/.

Known exceptions live in scripts/size_allowlist.txt, one a line:
``path[:function] <limit> # reason`` (the limit is today's size: growing past it fails too).
Exit 1 when a file or function exceeds its limit and is not allowed; exit 0 otherwise; exit 2
on an argument other than these:
Usage: python scripts/check_sizes.py [--all] [--help]   (--all also prints the allowed ones)
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = ("megatron_zeppelin", "scripts")
FILE_LINES = 500
FUNCTION_LINES = 50
ALLOWLIST = ROOT / "scripts" / "size_allowlist.txt"


def sizes() -> dict[str, int]:
    """Every file over FILE_LINES and function over FUNCTION_LINES: ``path[:qualname]`` -> lines."""
    found = {}
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            text = path.read_text()
            lines = len(text.splitlines())
            if lines > FILE_LINES:
                found[rel] = lines
            found.update(long_functions(rel, ast.parse(text)))
    return found


def long_functions(rel: str, module: ast.Module) -> dict[str, int]:
    found = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    start = min([child.lineno] + [d.lineno for d in child.decorator_list])
                    length = child.end_lineno - start + 1
                    if length > FUNCTION_LINES:
                        found[f"{rel}:{name}"] = length
                visit(child, name + ".")
    visit(module, "")
    return found


def allowed() -> dict[str, int]:
    limits = {}
    for number, line in enumerate(ALLOWLIST.read_text().splitlines(), 1):
        entry = line.split("#", 1)[0].split()
        if not entry:
            continue
        if len(entry) != 2 or not entry[1].isdigit() or "#" not in line:
            raise SystemExit(f"{ALLOWLIST.name}:{number}: want 'path[:function] lines # reason', got {line!r}")
        limits[entry[0]] = int(entry[1])
    return limits


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(__doc__.strip().splitlines()[-1])
        return 0
    unknown = [arg for arg in argv if arg != "--all"]
    if unknown:
        print(f"check_sizes.py: error: unrecognized argument {unknown[0]!r}: expected --all or "
              "--help", file=sys.stderr)
        return 2
    found, limits = sizes(), allowed()
    bad = [f"{key}: {n} lines (limit {limits.get(key, FILE_LINES if ':' not in key else FUNCTION_LINES)})"
           for key, n in sorted(found.items()) if n > limits.get(key, 0)]
    if "--all" in argv:
        for key, n in sorted(found.items()):
            print(f"{key} {n}")
    stale = sorted(set(limits) - set(found))
    for key in stale:
        print(f"allowed but no longer over the limit (remove it from {ALLOWLIST.name}): {key}")
    for line in bad:
        print(f"too long: {line}")
    return 1 if bad or stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
