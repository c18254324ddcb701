"""The figures issue 39 tracks, from the source tree alone: package sizes, the largest files and
functions, imports of the package's own modules inside functions, import circles inside a package,
and module-level function names defined in more than one module.

    python scripts/code_figures.py            # src/scalable_transformer of this checkout
    python scripts/code_figures.py --json     # the same, machine-readable

Counts lines with `wc -l`'s rule (newlines); a function's length runs from its `def` line to its last
line. Circles are found with grimp (installed with import-linter), counting imports inside functions.
"""

from __future__ import annotations

import argparse
import ast
import collections
import itertools
import json
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "scalable_transformer"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_own_import(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return bool(node.level) or (node.module or "").startswith(PACKAGE)
    if isinstance(node, ast.Import):
        return any(alias.name.startswith(PACKAGE) for alias in node.names)
    return False


def figures(top: int = 10) -> dict:
    sizes: collections.Counter[str] = collections.Counter()
    files: list[tuple[int, str]] = []
    functions: list[tuple[int, str]] = []
    inner: collections.Counter[str] = collections.Counter()
    defined: dict[str, set[str]] = collections.defaultdict(set)
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        text = path.read_text()
        lines = text.count("\n")
        module = _module_name(path)
        rel = path.relative_to(ROOT / PACKAGE)
        sizes[rel.parts[0] if len(rel.parts) > 1 else "(top level)"] += lines
        files.append((lines, str(rel)))
        tree = ast.parse(text)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defined[node.name].add(module)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                functions.append((length, f"{rel}:{node.lineno} {node.name}"))
                # a nested function's imports are counted once, at the outermost function
                inner[module] += sum(1 for sub in ast.walk(node) if _is_own_import(sub))
                for sub in ast.walk(node):
                    if sub is not node and isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        inner[module] -= sum(1 for s in ast.walk(sub) if _is_own_import(s))
    graph = grimp.build_graph(PACKAGE)
    circles = []
    for a, b in itertools.combinations(sorted(graph.modules), 2):
        if a.rsplit(".", 1)[0] != b.rsplit(".", 1)[0]:
            continue
        if graph.find_shortest_chain(importer=a, imported=b) and graph.find_shortest_chain(
            importer=b, imported=a
        ):
            circles.append(f"{a} <-> {b}")
    functions.sort(reverse=True)
    return {
        "total_lines": sum(sizes.values()),
        "package_lines": dict(sizes.most_common()),
        "largest_files": [f"{n} {name}" for n, name in sorted(files, reverse=True)[:top]],
        "largest_functions": [f"{n} {name}" for n, name in functions[:top]],
        "functions_over_80_lines": sum(1 for n, _ in functions if n > 80),
        "inner_own_imports": sum(inner.values()),
        "inner_own_imports_by_module": {m: c for m, c in inner.most_common() if c},
        "circles_inside_packages": circles,
        "function_names_in_several_modules": {
            name: sorted(mods) for name, mods in sorted(defined.items()) if len(mods) > 1
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--top", type=int, default=10, help="how many of the largest files and functions")
    args = parser.parse_args()
    out = figures(args.top)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"lines in src/{PACKAGE}: {out['total_lines']}")
    print("by package: " + ", ".join(f"{k} {v}" for k, v in out["package_lines"].items()))
    print("largest files:\n  " + "\n  ".join(out["largest_files"]))
    print("largest functions:\n  " + "\n  ".join(out["largest_functions"]))
    print(f"functions over 80 lines: {out['functions_over_80_lines']}")
    print(f"imports of the package's own modules inside functions: {out['inner_own_imports']}")
    print(f"import circles inside a package: {len(out['circles_inside_packages'])}")
    for circle in out["circles_inside_packages"]:
        print(f"  {circle}")
    names = out["function_names_in_several_modules"]
    print(f"module-level function names defined in several modules: {len(names)}")
    for name, mods in names.items():
        print(f"  {name}: {', '.join(mods)}")


if __name__ == "__main__":
    main()
