"""The package's import rules, read from the README's module map.

Two layers: the lesson modules (``d2lgpu/*.py``) and the runtime (``d2lgpu/runtime/``). The
runtime imports no lesson module; a lesson module takes from the runtime only the names a
runtime module exports (its ``__all__``). Among the lesson modules, a chapter's module
imports only shared modules and modules of earlier chapters (the one documented exception:
the precision vocabulary, from chapter 4 on). Nothing imports in a circle."""

import ast
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE = REPO_ROOT / "d2lgpu"
SHARED = 0  # the map's "all" row
# README: "with one exception: the precision vocabulary (precision_policy, in precision),
# which every trainer takes from chapter 4 on".
EXCEPTIONS = {"precision": 4}


def module_chapters() -> dict[str, int]:
    """Module -> chapter (0: shared), from the README's table "Where a chapter's helpers live"."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    table = text[text.index("### Where a chapter's helpers live"):]
    chapters = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not (cells[0].isdigit() or cells[0] == "all"):
            continue
        chapter = SHARED if cells[0] == "all" else int(cells[0])
        # The modules are the backticked names that open the cell or follow a comma or "and".
        for name in re.findall(r"(?:^|\), |, | and )`([a-z_]+)`", cells[2]):
            chapters.setdefault(name, chapter)
    return chapters


def moved_down() -> set[str]:
    """The modules the README says moved down to shared use ("that is how `devices`, ...
    came to be used everywhere"): introduced by a chapter, importable by every one."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    sentence = re.search(r"that is how (.*?) came to be used everywhere", text, re.S)
    return set(re.findall(r"`([a-z_]+)`", sentence.group(1))) if sentence else set()


def _module_name(dotted: str) -> str:
    """"d2lgpu.devices" -> "devices"; "d2lgpu.runtime.gpus" -> "runtime.gpus"."""
    parts = dotted.split(".")[1:]
    return ".".join(parts[:2]) if parts[0] == "runtime" else parts[0]


def imports_of(path: Path) -> set[str]:
    """The d2lgpu modules ``path`` imports, at module level or inside functions; a runtime
    module as ``runtime.<name>``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "d2lgpu":
                found.update(alias.name for alias in node.names)
            elif node.module == "d2lgpu.runtime":
                found.update(f"runtime.{alias.name}" for alias in node.names)
            elif node.module.startswith("d2lgpu."):
                found.add(_module_name(node.module))
        elif isinstance(node, ast.Import):
            found.update(_module_name(a.name) for a in node.names
                         if a.name.startswith("d2lgpu."))
    return found


def names_taken_from_runtime(path: Path) -> dict[str, set[str]]:
    """For each runtime module that ``path`` imports names from: those names."""
    taken: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("d2lgpu.runtime."):
            taken.setdefault(node.module, set()).update(a.name for a in node.names)
    return taken


def exported(module: str) -> set[str]:
    """The ``__all__`` of a runtime module, read from its source."""
    tree = ast.parse((PACKAGE / "runtime" / f"{module.split('.')[-1]}.py").read_text("utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__"
                                                for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("__"))
RUNTIME = sorted(f"runtime.{p.stem}" for p in (PACKAGE / "runtime").glob("*.py")
                 if not p.stem.startswith("__"))


def _path(module: str) -> Path:
    return PACKAGE / (module.replace(".", "/") + ".py")


def test_the_runtime_holds_the_machinery():
    assert {"runtime.checks", "runtime.config", "runtime.distributed", "runtime.progress",
            "runtime.gpus"} <= set(RUNTIME)


@pytest.mark.parametrize("module", RUNTIME)
def test_the_runtime_imports_no_lesson_module(module):
    lesson = imports_of(_path(module)) - set(RUNTIME) - {module}
    assert not lesson, f"d2lgpu.{module} imports lesson module(s) {sorted(lesson)}"


@pytest.mark.parametrize("module", MODULES + ["exercises/" + p.stem for p in
                                              sorted((PACKAGE / "exercises").glob("*.py"))])
def test_a_lesson_module_takes_only_exported_names_from_the_runtime(module):
    for runtime_module, names in names_taken_from_runtime(PACKAGE / f"{module}.py").items():
        hidden = names - exported(runtime_module)
        assert not hidden, (f"d2lgpu.{module} imports {sorted(hidden)} from {runtime_module}, "
                            "which does not export them (its __all__)")


def test_the_module_map_names_every_module():
    chapters = module_chapters()
    assert chapters["fast"] == 7 and chapters["training"] == 4 and chapters["plotting"] == SHARED
    assert set(MODULES) <= set(chapters), set(MODULES) - set(chapters)
    assert not set(chapters) & {m.split(".")[1] for m in RUNTIME}, "a runtime module in the map"
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### The runtime"):].split("\n#", 1)[0]
    for module in RUNTIME:
        assert f"`{module.split('.')[1]}`" in section, f"README's runtime section lacks {module}"


@pytest.mark.parametrize("module", MODULES)
def test_a_module_imports_only_shared_and_earlier_chapters(module):
    chapters = module_chapters()
    shared = moved_down()
    own = chapters[module]
    for imported in imports_of(PACKAGE / f"{module}.py") - {module} - set(RUNTIME):
        theirs = SHARED if imported in shared else chapters[imported]
        if theirs == SHARED or (own != SHARED and theirs <= own):
            continue
        if imported in EXCEPTIONS and own >= EXCEPTIONS[imported]:
            continue
        if own == SHARED and imported in EXCEPTIONS:
            continue  # shared helpers may name the precision vocabulary too
        pytest.fail(f"d2lgpu.{module} (chapter {own or 'all'}) imports d2lgpu.{imported} "
                    f"(chapter {theirs or 'all'}): move the helper down instead")


def test_nothing_imports_in_a_circle():
    everything = MODULES + RUNTIME
    graph = {m: imports_of(_path(m)) & set(everything) - {m} for m in everything}
    state: dict[str, str] = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                pytest.fail("import circle: " + " -> ".join(path + [node, nxt]))
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = "done"

    for m in everything:
        if m not in state:
            visit(m, [])


EXERCISE_CHECKS = sorted((PACKAGE / "exercises").glob("ch[0-9][0-9].py"))


def test_every_chapter_has_its_exercise_checks_and_nothing_imports_them():
    assert [p.stem for p in EXERCISE_CHECKS] == [f"ch{n:02d}" for n in range(1, 11)]
    for module in MODULES:
        assert "exercises" not in imports_of(PACKAGE / f"{module}.py"), (
            f"d2lgpu.{module} imports d2lgpu.exercises: the checks sit on top of the package")


@pytest.mark.parametrize("path", EXERCISE_CHECKS, ids=lambda p: p.stem)
def test_a_chapters_exercise_checks_import_only_what_it_and_earlier_chapters_teach(path):
    chapters = module_chapters()
    shared = moved_down()
    own = int(path.stem[2:])
    for imported in imports_of(path) - {"exercises"} - set(RUNTIME):
        theirs = SHARED if imported in shared else chapters[imported]
        later = theirs != SHARED and theirs > own
        if later and not (imported in EXCEPTIONS and own >= EXCEPTIONS[imported]):
            pytest.fail(f"d2lgpu.exercises.{path.stem} imports d2lgpu.{imported}, taught in "
                        f"chapter {theirs}: an exercise may use only what its chapter has taught")
