"""The code's shape, as issue 20 set it: train.py under 1,000 lines and no function over 80
lines in the project's source (tests, benchmarks and experiments included), so one step stays
readable in one sitting."""

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sources():
    return sorted(glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "*", "*.py")))


def test_train_py_stays_under_a_thousand_lines():
    with open(os.path.join(ROOT, "train.py")) as f:
        assert len(f.read().splitlines()) < 1000


def test_no_function_is_longer_than_80_lines():
    long = []
    for path in sources():
        if os.sep + ".venv" + os.sep in path:
            continue
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} "
                            f"({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long
