"""The package's import rule, read from the README's module map: a chapter's module imports
only shared modules and modules of earlier chapters (the one documented exception: the
precision vocabulary, from chapter 4 on), and nothing imports in a circle."""

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


def imports_of(path: Path) -> set[str]:
    """The d2lgpu modules ``path`` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "d2lgpu":
                found.update(alias.name for alias in node.names)
            elif node.module.startswith("d2lgpu."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names
                         if a.name.startswith("d2lgpu."))
    return found


MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("__"))


def test_the_module_map_names_every_module():
    chapters = module_chapters()
    assert chapters["fast"] == 7 and chapters["training"] == 4 and chapters["config"] == SHARED
    assert set(MODULES) <= set(chapters), set(MODULES) - set(chapters)


@pytest.mark.parametrize("module", MODULES)
def test_a_module_imports_only_shared_and_earlier_chapters(module):
    chapters = module_chapters()
    shared = moved_down()
    own = chapters[module]
    for imported in imports_of(PACKAGE / f"{module}.py") - {module}:
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
    graph = {m: imports_of(PACKAGE / f"{m}.py") & set(MODULES) - {m} for m in MODULES}
    state: dict[str, str] = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                pytest.fail("import circle: " + " -> ".join(path + [node, nxt]))
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = "done"

    for m in MODULES:
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
    for imported in imports_of(path) - {"exercises"}:
        theirs = SHARED if imported in shared else chapters[imported]
        later = theirs != SHARED and theirs > own
        if later and not (imported in EXCEPTIONS and own >= EXCEPTIONS[imported]):
            pytest.fail(f"d2lgpu.exercises.{path.stem} imports d2lgpu.{imported}, taught in "
                        f"chapter {theirs}: an exercise may use only what its chapter has taught")
