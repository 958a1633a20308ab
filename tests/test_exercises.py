"""The chapters' exercises: every chapter ends with them, their checks fail on the stubs with
a message that says what to do, and pass on the solutions.

nbval runs the same cells again in the notebooks: the chapters' check cells are tagged
``raises-exception`` (nbval accepts their failure) and committed without output, as a
learner finds them; the solutions' check cells are committed with the line they print on
success, which nbval compares.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from d2lgpu.exercises import (
    ExerciseCheckFailed,
    ExerciseNotDone,
    ExerciseWrong,
    attempt,
    expect_close,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CHECK_TAG = "raises-exception"
EXERCISE_HEADING = re.compile(r"^\*\*(\d+)\.(\d+) ", re.MULTILINE)


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def _source(cell: dict) -> str:
    source = cell["source"]
    return source if isinstance(source, str) else "".join(source)


def _text(text: str | list[str]) -> str:
    return text if isinstance(text, str) else "".join(text)


def _tags(cell: dict) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def exercise_section(path: Path) -> list[dict]:
    """The chapter's cells from its "## Exercises" heading to the end."""
    cells = _cells(path)
    starts = [i for i, c in enumerate(cells)
              if c["cell_type"] == "markdown" and _source(c).lstrip().startswith("## Exercises")]
    assert len(starts) == 1, (
        f"{path.name}: expected one '## Exercises' heading, found {len(starts)}")
    return cells[starts[0]:]


def solutions_of(path: Path) -> Path:
    return path.parent / "solutions" / f"{path.stem}_solutions.ipynb"


def _is_check(cell: dict) -> bool:
    return cell["cell_type"] == "code" and _source(cell).lstrip().startswith("check.")


def test_every_chapter_has_its_solutions():
    assert len(CHAPTERS) == 10
    missing = [p.name for p in CHAPTERS if not solutions_of(p).is_file()]
    assert not missing, f"no solutions notebook for {missing} in notebooks/solutions/"
    names = {p.name for p in (REPO_ROOT / "notebooks" / "solutions").glob("*.ipynb")}
    assert names == {solutions_of(p).name for p in CHAPTERS}


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_a_chapter_ends_with_exercises_three_of_them_checkable(path):
    cells = _cells(path)
    section = exercise_section(path)
    later = [_source(c) for c in section[1:] if c["cell_type"] == "markdown"
             and _source(c).lstrip().startswith("## ")]
    assert not later, f"{path.name}: the Exercises section must be the chapter's last"
    assert len(section) < len(cells), path.name
    chapter = int(path.name[:2])
    text = "\n".join(_source(c) for c in section if c["cell_type"] == "markdown")
    numbers = [(int(a), int(b)) for a, b in EXERCISE_HEADING.findall(text)]
    assert len(numbers) >= 5, f"{path.name}: {len(numbers)} exercises, at least 5 wanted"
    assert numbers == [(chapter, k) for k in range(1, len(numbers) + 1)], (
        f"{path.name}: exercises must be numbered {chapter}.1, {chapter}.2, ... in order: "
        f"{numbers}")
    checks = [c for c in section if _is_check(c)]
    assert len(checks) >= 3, f"{path.name}: {len(checks)} checkable exercises, at least 3 wanted"
    assert f"solutions/{solutions_of(path).name}" in text, (
        f"{path.name}: the Exercises section must link to solutions/{solutions_of(path).name}")
    for cell in checks:
        # Committed as a learner finds it: not yet run. nbval runs it and, by the tag,
        # accepts the ExerciseNotDone that the test below checks for.
        assert CHECK_TAG in _tags(cell), f"{path.name}: check cell not tagged {CHECK_TAG}"
        assert cell["outputs"] == [] and cell["execution_count"] is None, (
            f"{path.name}: the check cell {_source(cell)!r} must be committed without output")


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_the_solutions_run_the_chapters_checks_and_pass_them(path):
    chapter_checks = [_source(c) for c in exercise_section(path) if _is_check(c)]
    solved = [c for c in _cells(solutions_of(path)) if _is_check(c)]
    assert [_source(c) for c in solved] == chapter_checks, (
        f"{solutions_of(path).name}: its check cells must be the chapter's, in the same order")
    for cell in solved:
        assert CHECK_TAG not in _tags(cell)
        text = "".join(_text(o.get("text", "")) for o in cell["outputs"]
                       if o["output_type"] == "stream")
        assert re.search(r"Exercise \d+\.\d+ passed", text), (
            f"{solutions_of(path).name}: {_source(cell)!r} is committed without passing")


def _run_cells(cells: list[dict], name: str) -> list[BaseException | None]:
    """Execute the code cells in one namespace, as a kernel would: what each check raised."""
    namespace: dict = {"__name__": "__main__"}
    outcomes = []
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        source = _source(cell)
        assert not re.search(r"^\s*[%!]", source, re.MULTILINE), (
            f"{name}: exercise cells are plain Python (no magics), so that this test runs them")
        if not _is_check(cell):
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(source, name, "exec"), namespace)
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(source, name, "exec"), namespace)
        except ExerciseCheckFailed as exc:
            outcomes.append(exc)
        else:
            outcomes.append(None)
    return outcomes


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_the_checks_fail_on_the_stubs_and_pass_on_the_solutions(path):
    on_stubs = _run_cells(exercise_section(path), path.name)
    assert on_stubs and all(isinstance(e, ExerciseNotDone) for e in on_stubs), (
        f"{path.name}: every check must raise ExerciseNotDone on the unchanged stubs: {on_stubs}")
    for exc in on_stubs:
        assert "is not done yet" in str(exc) and "Write its body" in str(exc)
    solution_cells = _cells(solutions_of(path))
    setup = next(i for i, c in enumerate(solution_cells) if c["cell_type"] == "code")
    on_solutions = _run_cells(solution_cells[setup + 1:], solutions_of(path).name)
    assert len(on_solutions) == len(on_stubs)
    assert on_solutions == [None] * len(on_solutions), (
        f"{solutions_of(path).name}: a check failed on the solution: "
        f"{[str(e) for e in on_solutions if e is not None]}")


def test_a_stub_becomes_exercise_not_done_without_its_traceback():
    def stub(x):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match=r"Exercise 1\.2 is not done yet: `stub`") as info:
        attempt("1.2", stub, 3)
    assert info.value.__suppress_context__
    # IPython shows one line, not the frames of the check.
    assert len(info.value._render_traceback_()) == 1
    assert "ExerciseNotDone" in info.value._render_traceback_()[0]


def test_a_forgotten_return_and_a_called_function_are_named():
    with pytest.raises(ExerciseWrong, match="returned None; does it end with `return`"):
        attempt("1.2", lambda x: None, 3)
    with pytest.raises(ExerciseWrong, match="pass the name without calling it"):
        attempt("1.2", 0.5)
    with pytest.raises(ExerciseWrong, match="should be a number"):
        expect_close("1.2", "0.5", 0.5, "the value")
    with pytest.raises(ExerciseWrong, match=r"the value is 0\.4, expected 0\.5"):
        expect_close("1.2", 0.4, 0.5, "the value")


def test_an_error_inside_the_learners_code_is_not_hidden():
    def wrong(x):
        return x[5]

    with pytest.raises(IndexError):
        attempt("1.2", wrong, [1, 2])


def test_a_check_that_wants_a_value_error_names_what_came_instead():
    from d2lgpu.exercises import expect_value_error

    def refuses(x):
        if x < 0:
            raise ValueError("negative")
        return x

    expect_value_error("1.2", refuses, (-1,), "-1 is no size")  # refused: passes
    with pytest.raises(ExerciseWrong, match=r"1 is no size; raise a ValueError that says so"):
        expect_value_error("1.2", refuses, (1,), "1 is no size")
    with pytest.raises(ExerciseWrong, match=r"raised IndexError: .*raise a ValueError"):
        expect_value_error("1.2", lambda x: [][x], (3,), "3 is out of range")
    with pytest.raises(ExerciseNotDone):
        expect_value_error("1.2", lambda x: (_ for _ in ()).throw(NotImplementedError), (1,),
                           "anything")


def test_a_stub_is_refused_before_the_check_builds_anything():
    from d2lgpu.exercises import refuse_stub_early

    def stub(a, b):
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone, match="Exercise 5.3 is not done yet: `stub`"):
        refuse_stub_early("5.3", stub, 2)
    refuse_stub_early("5.3", lambda a, b: a.step(b), 2)  # touches a stand-in: the check goes on
    refuse_stub_early("5.3", lambda a, b: len(a) + b[0], 2)


def test_a_tensor_check_names_the_case_the_shape_and_the_difference():
    import torch

    from d2lgpu.exercises import expect_tensor_close

    want = torch.ones(2, 3)
    expect_tensor_close("9.3", want + 1e-7, want, "with n=2", 1e-5, "hint")
    with pytest.raises(ExerciseWrong, match=r"with n=2: expected a tensor of shape \(2, 3\)"):
        expect_tensor_close("9.3", torch.ones(3, 2), want, "with n=2", 1e-5, "hint")
    with pytest.raises(ExerciseWrong, match=r"differs by up to 0\.5; look at the bias"):
        expect_tensor_close("9.3", want + 0.5, want, "with n=2", 1e-5, "look at the bias")
