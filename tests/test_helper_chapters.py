"""Every lesson helper a chapter calls names that chapter in its docstring, and the chapter's
text names the helper.

A reader who meets ``d2lgpu.split_batch`` in the package can go back to the chapter that
writes it out in plain PyTorch. The helpers are found the way a reader finds them: every
``d2lgpu`` name the chapters' code cells call or import, resolved to its function or class.
The runtime (``d2lgpu.runtime``) and the exercise checks are left out: a learner need not
read them.
"""

import ast
import importlib
import inspect
import json
import re
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _code(cell: dict) -> str:
    """The cell as Python, as IPython runs it (magics and shell lines become calls)."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell("".join(cell["source"]))


def chapter_helpers() -> dict[object, int]:
    """Each package function or class a chapter's code uses -> the first chapter that uses it."""
    first: dict[int, tuple[object, int]] = {}
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        chapter = int(path.name[:2])
        aliases = {"d2lgpu": "d2lgpu"}
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            tree = ast.parse(_code(cell))
            found = []
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("d2lgpu"):
                    module = importlib.import_module(node.module)
                    for alias in node.names:
                        obj = getattr(module, alias.name, None)
                        if obj is None:  # a submodule not yet imported: d2lgpu.exercises.ch01
                            obj = importlib.import_module(f"{node.module}.{alias.name}")
                        if inspect.ismodule(obj):
                            aliases[alias.asname or alias.name] = obj.__name__
                        else:
                            found.append(obj)
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.name.startswith("d2lgpu"):
                            aliases[alias.asname or alias.name] = alias.name
                elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                      and node.value.id in aliases):
                    found.append(getattr(importlib.import_module(aliases[node.value.id]),
                                         node.attr, None))
            for obj in found:
                if inspect.isfunction(obj) or inspect.isclass(obj):
                    first.setdefault(id(obj), (obj, chapter))
    return {obj: chapter for obj, chapter in first.values()
            if obj.__module__.startswith("d2lgpu")
            and not obj.__module__.startswith(("d2lgpu.runtime", "d2lgpu.exercises"))}


def test_the_scan_finds_the_helpers_chapters_are_known_to_call():
    helpers = {f"{obj.__module__}.{obj.__name__}": chapter
               for obj, chapter in chapter_helpers().items()}
    assert helpers["d2lgpu.parallel.split_batch"] == 3
    assert helpers["d2lgpu.training.train"] == 4
    assert helpers["d2lgpu.fast.train_fast"] == 7
    assert len(helpers) > 100


def test_every_lesson_helper_names_the_chapter_that_introduces_it():
    missing = []
    for obj, chapter in chapter_helpers().items():
        named = [int(n) for n in re.findall(r"[Cc]hapter (\d+)", inspect.getdoc(obj) or "")]
        if not any(n <= chapter for n in named):
            missing.append(f"{obj.__module__}.{obj.__name__} (first called in chapter {chapter})")
    assert not missing, "docstrings that name no chapter up to their first use:\n" + "\n".join(
        sorted(missing))


def test_every_lesson_helper_is_named_in_the_text_of_the_chapter_that_first_calls_it():
    prose = {}
    for path in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"):
        cells = json.loads(path.read_text())["cells"]
        prose[int(path.name[:2])] = "\n".join(
            "".join(cell["source"]) for cell in cells if cell["cell_type"] == "markdown")
    unnamed = sorted(f"chapter {chapter}: {obj.__module__}.{obj.__name__}"
                     for obj, chapter in chapter_helpers().items()
                     if not re.search(rf"\b{obj.__name__}\b", prose[chapter]))
    assert not unnamed, "helpers a chapter calls but its text never names:\n" + "\n".join(unnamed)


def _resolves(dotted: str) -> bool:
    """Whether ``d2lgpu.a.b`` names something: attributes first, then submodules."""
    obj, parts = importlib.import_module("d2lgpu"), dotted.split(".")[1:]
    for i, part in enumerate(parts):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(".".join(["d2lgpu", *parts[: i + 1]]))
        except ImportError:
            return False
    return True


def test_every_package_name_the_text_gives_exists():
    # A learner copies `d2lgpu.report.print_report()` from the prose into a cell; a name that
    # import d2lgpu does not have (a helper renamed, removed or living in a submodule) fails there.
    readme = NOTEBOOKS.parent / "README.md"
    texts = {readme.name: readme.read_text()}
    for path in sorted(NOTEBOOKS.glob("**/*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        texts[path.name] = "\n".join("".join(c["source"]) for c in cells
                                     if c["cell_type"] == "markdown")
    missing = [f"{name}: {dotted}" for name, text in texts.items()
               for span in re.findall(r"`([^`\n]+)`", text)
               for dotted in re.findall(r"(?<![\w./-])d2lgpu(?:\.[A-Za-z_]\w*)+", span)
               if not _resolves(dotted)]
    assert not missing, missing
