"""The code's shape, for the maintainers' review (not a test a fork trips over): train.py under
1,000 lines and no function over 80 lines in the project's source (tests, benchmarks and
experiments included), so one step stays readable in one sitting. .ci/run calls it."""

import ast
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def problems():
    out = []
    with open(os.path.join(ROOT, "train.py")) as f:
        lines = len(f.read().splitlines())
    if lines >= 1000:
        out.append(f"train.py: {lines} lines (keep it under 1,000)")
    sources = sorted(glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "*", "*.py")))
    for path in sources:
        if os.sep + ".venv" + os.sep in path:
            continue
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                out.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} "
                           f"({node.end_lineno - node.lineno + 1} lines; keep functions under 80)")
    return out


if __name__ == "__main__":
    found = problems()
    print("\n".join(found) or "shape ok: train.py and every function within their limits")
    sys.exit(1 if found else 0)
