"""The code's shape, for the maintainers' review (not a test a fork trips over). .ci/run calls it.

- train.py under 1,000 lines and no function over 80 lines in the project's source (tests,
  benchmarks and experiments included), so one step stays readable in one sitting.
- The modules read bottom-up (LAYERS): a module imports only modules of its own layer or below,
  the imports between modules form no circle, and no module imports another inside a function
  (a deferred import is for an optional heavy library, never for a module of ours). Entry
  points (eval.py, bench/, experiments/, data/'s scripts, tests/) sit above every layer and
  import what they like.
"""

import ast
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAYERS = [  # bottom first
    ("pure math and data", ["grpo", "distill", "shaping", "dist", "forward", "plot", "data"]),
    ("prompts and rewards", ["prompts", "verify", "gepa", "scoring"]),
    ("settings", ["config"]),
    ("models and engines", ["model", "lora", "rollout"]),
    ("a run's files", ["runs"]),
    ("the loop", ["train"]),
]
LAYER = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}
ENTRY_POINTS = {"eval"}  # top-level scripts above every layer


def module_of(path):
    rel = os.path.relpath(path, ROOT)
    return "data" if rel == os.path.join("data", "__init__.py") else rel[:-3].replace(os.sep, ".")


def imports(tree, modules):
    """[(imported module, line, inside a function)] of the project's modules imported by `tree`."""
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            names = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                names = [child.module]
            for name in names:
                if name.split(".")[0] in modules:
                    found.append((name.split(".")[0], child.lineno, in_function))
            visit(child, inner)

    visit(tree, False)
    return found


def import_problems(sources):
    """Upward arrows, circles and in-function imports among the layered modules."""
    graph, out = {}, []
    for path, tree in sources.items():
        me = module_of(path)
        if me not in LAYER and me not in ENTRY_POINTS:
            continue  # bench/, experiments/, tests/, data/'s scripts
        graph[me] = set()
        for other, line, in_function in imports(tree, set(LAYER) | ENTRY_POINTS):
            where = f"{os.path.relpath(path, ROOT)}:{line}"
            if other == me:
                continue
            graph[me].add(other)
            if me in ENTRY_POINTS:  # above every layer: its imports only close circles
                continue
            if in_function:
                out.append(f"{where} imports {other} inside a function (import it at the top; a deferred "
                           "import is for an optional heavy library only)")
            if LAYER.get(other, len(LAYERS)) > LAYER[me]:
                above = LAYERS[LAYER[other]][0] if other in LAYER else "an entry point"
                out.append(f"{where}: {me} ({LAYERS[LAYER[me]][0]}) imports {other} ({above}), a layer above it")
    for group in circles(graph):
        out.append(f"import circle among {', '.join(group)}: " + " -> ".join(cycle_through(graph, group)))
    missing = sorted(module_of(p) for p in sources if os.path.dirname(p) == ROOT
                     and module_of(p) not in LAYER and module_of(p) not in ENTRY_POINTS)
    out += [f"{m}.py is in no layer of .ci/shape.py's LAYERS (nor an entry point): place it" for m in missing]
    return out


def circles(graph):
    """Each strongly connected group of more than one module (Tarjan), as a list of names."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def cycle_through(graph, group):
    """One circle of imports inside a strongly connected `group`, from its first module back to it
    (breadth first: the shortest), as the modules along it."""
    start, paths = group[0], [[group[0]]]
    while paths:
        path = paths.pop(0)
        for w in sorted(graph.get(path[-1], set()) & set(group)):
            if w == start:
                return path + [start]
            if w not in path:
                paths.append(path + [w])
    return group + [start]


def repository_sources():
    """{path: parsed module} of the project's source: the top level and one folder down."""
    paths = sorted(glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "*", "*.py")))
    sources = {}
    for path in paths:
        if os.sep + ".venv" + os.sep not in path:
            with open(path) as f:
                sources[path] = ast.parse(f.read())
    return sources


def problems():
    out = []
    with open(os.path.join(ROOT, "train.py")) as f:
        lines = len(f.read().splitlines())
    if lines >= 1000:
        out.append(f"train.py: {lines} lines (keep it under 1,000)")
    sources = repository_sources()
    for path, tree in sources.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                out.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} "
                           f"({node.end_lineno - node.lineno + 1} lines; keep functions under 80)")
    return out + import_problems(sources)


if __name__ == "__main__":
    found = problems()
    print("\n".join(found) or "shape ok: train.py and every function within their limits; the imports read bottom-up")
    sys.exit(1 if found else 0)
