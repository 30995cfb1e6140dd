""".ci/shape.py's import rules: the house reads bottom-up, and a circle, an upward import or a
project import inside a function fails it (so the circle of issue 51 cannot come back)."""

import ast
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("shape", os.path.join(ROOT, ".ci", "shape.py"))
shape = importlib.util.module_from_spec(spec)
spec.loader.exec_module(shape)


def sources(**modules):
    return {os.path.join(ROOT, f"{name}.py"): ast.parse(text) for name, text in modules.items()}


def test_the_repository_reads_bottom_up():
    """The import rules only: the size limits stay the maintainers' (.ci/run), not a test a fork trips over."""
    assert shape.import_problems(shape.repository_sources()) == []


def test_a_circle_an_upward_import_and_a_deferred_one_are_each_named():
    found = shape.import_problems(sources(
        config="import grpo\nimport rollout\n",  # settings -> models: upward
        rollout="import model\n",
        model="def f():\n    import config\n",  # deferred, and closes config -> rollout -> model -> config
    ))
    assert any("config.py:2: config (settings) imports rollout (models and engines), a layer above it" in p
               for p in found)
    assert any("model.py:2 imports config inside a function" in p for p in found)
    assert "import circle among config, model, rollout: config -> rollout -> model -> config" in found
    assert len(found) == 3


def test_imports_downward_and_inside_the_layer_pass_and_third_party_may_be_deferred():
    assert shape.import_problems(sources(
        forward="import dist\nimport grpo\n", gepa="from prompts import user_text\nimport verify\n",
        rollout="import config\nfrom model import resolve_model\n\ndef f():\n    import vllm\n",
    )) == []


def test_a_circle_inside_one_layer_fails_too():
    found = shape.import_problems(sources(grpo="import distill\n", distill="import grpo\n"))
    assert found == ["import circle among distill, grpo: distill -> grpo -> distill"]


def test_a_new_top_level_module_must_be_placed():
    found = shape.import_problems(sources(newthing="import grpo\n"))
    assert found == ["newthing.py is in no layer of .ci/shape.py's LAYERS (nor an entry point): place it"]
