"""Checks on the repository as a whole: notebooks, lint, README vs CI, conda vs pip."""

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="on Python 3.10 reading TOML needs tomli")

REPO_ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("*.ipynb")) + sorted(
    (REPO_ROOT / "notebooks" / "solutions").glob("*.ipynb"))
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))

# The first code cell of every notebook, character for character.
SETUP_CELL = """\
# On Colab or Kaggle the course package is not installed yet: install it from the course
# repository, keeping the torch and torchvision the platform ships. Their CUDA build matches
# the platform's GPU driver; the newest one on PyPI may need a newer driver, and CUDA would
# then be unusable. Wherever d2lgpu is already importable this cell does nothing.
import importlib.metadata
import importlib.util
import subprocess
import sys
import tempfile

COURSE_REPO = "https://github.com/d2lgpu/d2lgpu"
if importlib.util.find_spec("d2lgpu") is None:
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    ships = {name: importlib.metadata.version(name) for name in ("torch", "torchvision")
             if importlib.util.find_spec(name) is not None}
    if "torch" in ships and tuple(map(int, ships["torch"].split(".")[:2])) < (2, 9):
        print(f"torch {ships['torch']} is older than the course's 2.9: kept, so CUDA keeps "
              "working. Chapters 8 and 9 need 2.9 (FSDP2 on CPU processes averages gradients "
              "correctly from 2.9 on, pytorch/pytorch#162338); the course is tested on 2.9 "
              "and newer only.")
        subprocess.run([*pip, "--no-deps", f"git+{COURSE_REPO}"], check=True)
        subprocess.run([*pip, "matplotlib>=3.7", "tqdm>=4.60", "nvidia-ml-py>=12.535"],
                       check=True)
    else:  # a constraint: pip may add packages, but not replace the platform's torch
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as keep:
            keep.write("".join(f"{name}=={version}\\n" for name, version in ships.items()))
        subprocess.run([*pip, "-c", keep.name, f"git+{COURSE_REPO}"], check=True)
"""

IGNORE_OUTPUT_TAG = "nbval-ignore-output"


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def _source(cell: dict) -> str:
    source = cell["source"]
    return source if isinstance(source, str) else "".join(source)


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks found under notebooks/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_first_code_cell_is_the_setup_cell(path):
    code_cells = [cell for cell in _cells(path) if cell["cell_type"] == "code"]
    assert code_cells, f"{path.name} has no code cell"
    first = code_cells[0]
    assert _source(first).rstrip("\n") + "\n" == SETUP_CELL, (
        f"{path.name}: the first code cell must be the canonical setup cell"
    )
    assert first.get("outputs", []) == [], f"{path.name}: the setup cell must have no output"


def test_setup_cell_installs_from_the_repository_in_pyproject():
    repository = PYPROJECT["project"]["urls"]["Repository"]
    match = re.search(r'^COURSE_REPO = "([^"]+)"$', SETUP_CELL, re.MULTILINE)
    assert match is not None
    assert match.group(1) == repository


def _run_setup_cell(monkeypatch, shipped: dict[str, str]) -> tuple[list[list[str]], list[str]]:
    """Run the setup cell where d2lgpu is missing and ``shipped`` are the platform's packages:
    the pip commands it runs, and the constraints it hands pip (nothing is installed)."""
    import importlib.metadata
    import importlib.util
    import subprocess

    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        if name == "d2lgpu" or name in ("torch", "torchvision") and name not in shipped:
            return None
        return real_find_spec(name, *args)

    commands, constraints = [], []

    def run(command, check):
        commands.append(list(command))
        if "-c" in command:
            constraints.append(Path(command[command.index("-c") + 1]).read_text())

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: shipped[name])
    monkeypatch.setattr(subprocess, "run", run)
    exec(compile(SETUP_CELL, "setup cell", "exec"), {})
    return commands, constraints


@pytest.mark.parametrize("shipped", [
    {"torch": "2.10.0+cu126", "torchvision": "0.25.0+cu126"},  # Colab-like: a CUDA build
    {"torch": "2.9.1"},
])
def test_the_setup_cell_keeps_the_platforms_torch(monkeypatch, shipped):
    commands, constraints = _run_setup_cell(monkeypatch, shipped)
    assert len(commands) == 1 and commands[0][-1].startswith("git+")
    assert not {"-U", "--upgrade", "--force-reinstall"} & set(commands[0])
    # The constraint pins exactly what the platform ships, so pip cannot replace it.
    assert constraints == ["".join(f"{n}=={v}\n" for n, v in shipped.items())]


def test_the_setup_cell_never_upgrades_a_torch_below_the_floor(monkeypatch, capsys):
    commands, _ = _run_setup_cell(monkeypatch, {"torch": "2.6.0+cu124", "torchvision": "0.21.0"})
    named = [arg for command in commands for arg in command[4:]]
    assert not any(arg.split("=")[0].split(">")[0] in ("torch", "torchvision") for arg in named)
    assert "--no-deps" in commands[0] and commands[0][-1].startswith("git+")
    assert "Chapters 8 and 9 need 2.9" in capsys.readouterr().out


def test_the_setup_cell_installs_torch_where_there_is_none(monkeypatch):
    commands, constraints = _run_setup_cell(monkeypatch, {})
    assert len(commands) == 1 and constraints == [""]  # nothing to keep: pip picks torch


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_has_no_errors_and_enough_checked_outputs(path):
    checked = 0
    for index, cell in enumerate(_cells(path)):
        if cell["cell_type"] != "code":
            continue
        outputs = cell.get("outputs", [])
        errors = [o for o in outputs if o.get("output_type") == "error"]
        assert not errors, f"{path.name}, cell {index}: committed with an error output {errors[0]}"
        if outputs and IGNORE_OUTPUT_TAG not in cell.get("metadata", {}).get("tags", []):
            checked += 1
    assert checked >= 3, (
        f"{path.name}: only {checked} code cell(s) with outputs that nbval checks; "
        f"at least 3 must carry outputs not tagged {IGNORE_OUTPUT_TAG}"
    )


def test_ruff_passes():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]' installs it)")
    paths = [p for p in ("d2lgpu", "tests", "notebooks", "benchmarks") if (REPO_ROOT / p).exists()]
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", *paths],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_readme_test_command_is_what_ci_runs():
    readme = REPO_ROOT / "README.md"
    assert readme.exists(), "README.md is missing; it must show the test command that CI runs"
    commands = [
        line.strip()
        for line in readme.read_text(encoding="utf-8").splitlines()
        if line.strip().startswith("python3 -m venv") and line.strip().endswith("pytest")
    ]
    assert commands, (
        "README.md has no line that starts with `python3 -m venv` and ends with `pytest` "
        "(the test command)"
    )
    ci_script = (REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8")
    for command in commands:
        assert command in ci_script, f"README's test command is not in .ci/run: {command}"


def _requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match is not None, f"cannot read a package name from {requirement!r}"
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def _requirement_spec(requirement: str) -> str:
    """The version part of a requirement (``>=2.1`` of ``torch>=2.1``), spaces removed."""
    return re.sub(r"\s+", "", re.sub(r"^\s*[A-Za-z0-9][A-Za-z0-9._-]*", "", requirement))


def _pip_section_of_environment_yml() -> list[str]:
    """The entries under `- pip:` in environment.yml (a plain reader: no YAML library needed)."""
    lines = (REPO_ROOT / "environment.yml").read_text(encoding="utf-8").splitlines()
    entries: list[str] = []
    pip_indent: int | None = None
    for line in lines:
        stripped = line.split("#", 1)[0].rstrip()
        if not stripped.strip():
            continue
        indent = len(stripped) - len(stripped.lstrip())
        if stripped.strip() == "- pip:":
            pip_indent = indent
            continue
        if pip_indent is not None:
            if indent <= pip_indent:
                break
            assert stripped.strip().startswith("- "), f"unexpected line in the pip section: {line}"
            entries.append(stripped.strip()[2:].strip().strip("'\""))
    assert pip_indent is not None, "environment.yml has no `- pip:` section"
    return entries


def test_environment_yml_matches_pip_dependencies():
    project = PYPROJECT["project"]
    extras = project["optional-dependencies"]
    pip_requirements = project["dependencies"] + extras["course"] + extras["dev"]
    expected = {_requirement_name(r): _requirement_spec(r) for r in pip_requirements}
    conda_entries = [e for e in _pip_section_of_environment_yml() if not e.startswith("-e ")]
    listed = {_requirement_name(e): _requirement_spec(e) for e in conda_entries}
    expected.pop("pycuda", None)
    listed.pop("pycuda", None)
    assert sorted(listed) == sorted(expected), "environment.yml and pyproject.toml differ"
    assert listed == expected, "environment.yml and pyproject.toml ask for different versions"
    assert "-e ." in _pip_section_of_environment_yml(), "environment.yml must install `-e .`"


def _release(version: str) -> tuple[int, ...]:
    """``2.8`` and ``2.8.0`` as the same release: (2, 8, 0), trailing zeros padded to 3."""
    parts = tuple(int(p) for p in version.split("."))
    return parts + (0,) * (3 - len(parts))


def test_ci_tests_the_oldest_torch_and_torchvision_that_pyproject_allows():
    ci_script = (REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8")
    dependencies = {
        _requirement_name(r): _requirement_spec(r) for r in PYPROJECT["project"]["dependencies"]
    }
    for package, variable in (("torch", "FLOOR_TORCH"), ("torchvision", "FLOOR_TORCHVISION")):
        spec = dependencies[package]
        lower = re.fullmatch(r">=([0-9]+(?:\.[0-9]+)*)", spec)
        assert lower is not None, f"pyproject.toml: {package} must be `>=floor`, got {spec!r}"
        pinned = re.search(rf"^{variable}=([0-9.]+)$", ci_script, re.MULTILINE)
        assert pinned is not None, f".ci/run must set {variable}=<version> (the floor it tests)"
        assert _release(pinned.group(1)) == _release(lower.group(1)), (
            f".ci/run tests {package} {pinned.group(1)}, but pyproject.toml allows "
            f"{package}{spec}: test the oldest version that is allowed, or raise the floor"
        )


def test_run_on_gpu_needs_only_what_the_dev_extra_installs():
    script = (REPO_ROOT / "benchmarks" / "run_on_gpu.sh").read_text(encoding="utf-8")
    assert "jupyter " not in script, "run_on_gpu.sh must not need a full Jupyter install"
    assert "benchmarks/run_notebook.py" in script
    dev = {_requirement_name(r) for r in PYPROJECT["project"]["optional-dependencies"]["dev"]}
    assert {"nbclient", "nbformat", "ipykernel"} <= dev


def test_run_notebook_executes_in_place_and_keeps_outputs(tmp_path):
    import subprocess
    import sys

    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("print(6 * 7)"),
                nbformat.v4.new_code_cell("raise NotImplementedError")]
    nb.cells[1].metadata["tags"] = ["raises-exception"]  # an exercise's check on its stub
    path = tmp_path / "tiny.ipynb"
    nbformat.write(nb, path)
    done = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "run_notebook.py"),
                           str(path), "--timeout", "60"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    cells = nbformat.read(path, as_version=4).cells
    assert cells[0].outputs and cells[0].outputs[0]["text"].strip() == "42"
    assert cells[1].outputs == [] and cells[1].execution_count is None
    missing = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "run_notebook.py"),
                              str(tmp_path / "nope.ipynb")], capture_output=True, text=True)
    assert missing.returncode == 2 and "is not a file" in missing.stderr


def test_ci_runs_every_notebook_in_smoke_mode_and_the_other_cpu_branch():
    ci_script = (REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8")
    # The floor job runs every test, the slow ones and the notebooks included, in smoke mode,
    # with the CPU's bf16 answer flipped, read before it is overridden.
    assert "flipped=$((1 - machine_bf16))" in ci_script
    assert re.search(r'&& D2LGPU_SMOKE=1 D2LGPU_CPU_BF16=\$flipped pytest -m "slow or not slow" '
                     r"\|\| floor_status=\$\?", ci_script)
    assert ci_script.index("machine_bf16=$(") < ci_script.index("D2LGPU_CPU_BF16=$flipped")
    # And every part's status decides CI.
    assert 'for s in "$status" "$floor_status"' in ci_script


def _root_conftest():
    spec = importlib.util.spec_from_file_location("root_conftest", REPO_ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Item:
    def __init__(self, nodeid, tags=None):
        self.nodeid = nodeid
        if tags is not None:  # a notebook cell
            self.cell = {"metadata": {"tags": tags}}
        self.options = {"check": True}
        self.markers = []

    def add_marker(self, marker):
        self.markers.append(marker.name)


def test_smoke_mode_compares_every_checked_cell_but_the_tagged_ones():
    # A tagged cell is run and not compared in smoke mode, and compared in quick mode.
    conftest = _root_conftest()
    tagged = _Item("notebooks/x.ipynb::Cell 1", [conftest.SMOKE_IGNORE_TAG])
    plain = _Item("notebooks/x.ipynb::Cell 2", ["raises-exception"])
    for smoke, expected in ((True, False), (False, True)):
        tagged.options["check"] = plain.options["check"] = True
        conftest.SMOKE = smoke
        conftest.pytest_collection_modifyitems(None, [tagged, plain, _Item("tests/t.py::f")])
        assert tagged.options["check"] is expected and plain.options["check"] is True


def test_the_solution_notebooks_run_with_the_slow_tests():
    conftest = _root_conftest()
    solution = _Item("notebooks/solutions/01_cuda_checks_solutions.ipynb::Cell 0", [])
    chapter = _Item("notebooks/01_cuda_checks.ipynb::Cell 0", [])
    conftest.pytest_collection_modifyitems(None, [solution, chapter])
    assert solution.markers == ["slow"] and chapter.markers == []


def test_the_slowest_files_go_first_and_keep_their_order():
    conftest = _root_conftest()
    for path in conftest.SLOWEST_FIRST:
        assert (REPO_ROOT / path).is_file(), f"SLOWEST_FIRST names {path}, which is gone"
    first, second = conftest.SLOWEST_FIRST[:2]
    items = [_Item("tests/a.py::x"), _Item(f"{second}::Cell 0"), _Item(f"{first}::Cell 0"),
             _Item(f"{second}::Cell 1"), _Item("tests/a.py::y"), _Item(f"{first}::Cell 1")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == [
        f"{first}::Cell 0", f"{first}::Cell 1", f"{second}::Cell 0", f"{second}::Cell 1",
        "tests/a.py::x", "tests/a.py::y"]


def test_the_root_conftest_leaves_smoke_mode_alone():
    # Quick mode wins over smoke mode, so the test session must not switch it on then.
    env = {k: v for k, v in os.environ.items() if not k.startswith("D2LGPU_")}
    code = "import conftest, os; print(os.environ.get('D2LGPU_QUICK'))"
    for smoke, quick in (("1", "None"), ("", "1")):
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, text=True,
                              capture_output=True, env={**env, "D2LGPU_SMOKE": smoke},
                              timeout=60, check=True)
        assert done.stdout.strip() == quick


@pytest.mark.skipif(not __import__("zmq").has("ipc"),
                    reason="zmq has no Unix sockets on this platform (Windows): kernels use TCP")
def test_notebook_kernels_listen_on_socket_files_not_ports():
    # The root conftest, loaded by this session, gives nbval's kernels Unix sockets: no port
    # that another process's connection can take between its choice and the kernel's bind.
    import nbval.kernel

    kernel = nbval.kernel.RunningKernel(nbval.kernel.CURRENT_ENV_KERNEL_NAME,
                                        cwd=str(REPO_ROOT / "notebooks"))
    try:
        info = json.loads(Path(kernel.km.connection_file).read_text())
        assert info["transport"] == "ipc" and Path(info["ip"]).is_absolute()
        assert Path(f"{info['ip']}-{info['shell_port']}").exists()
        msg_id = kernel.execute_cell_input("print(6 * 7)", allow_stdin=False)
        kernel.await_reply(msg_id, timeout=60)
        printed = ""
        while "42" not in printed:
            msg = kernel.get_message("iopub", timeout=30)
            if msg["msg_type"] == "stream":
                printed += msg["content"]["text"]
    finally:
        kernel.stop()


CHAPTERS = sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name[:2])
def test_a_chapter_states_its_time_up_front_and_says_before_the_exercises_what_it_took(path):
    # The stated times are written in the text (measured, not computed); the chapter's own
    # cells take the time, in plain code a learner reads, and print it before the exercises.
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    text = " ".join(" ".join("".join(c["source"]).split())
                    for c in cells[:8] if c["cell_type"] == "markdown")
    statement = text[text.index("**How long it takes**"):]
    duration = r"about \d+(\.\d)? (s|min)"
    assert re.search(rf"{duration} when nothing else runs, and {duration} with two other "
                     rf"programs keeping both cores busy", statement), statement[:300]
    assert re.search(rf"the mode the tests run, takes {duration}\.", statement), statement[:300]
    assert "The cell before the exercises says how long the chapter took here." in statement
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    first = next(i for i, source in enumerate(code)
                 if "chapter_start = time.perf_counter()" in source)
    assert first < 4, "the clock starts in the chapter's first cells"
    exercises = next(i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
                     and re.match(r"#+ .*Exercises", "".join(c["source"])))
    before = [c for c in cells[:exercises] if c["cell_type"] == "code"][-1]
    assert "time.perf_counter() - chapter_start" in "".join(before["source"])
    assert "nbval-ignore-output" in before["metadata"].get("tags", [])


def _distributed_scripts() -> list[tuple[str, str]]:
    """(notebook and file name, source) of every script a notebook writes that joins a group."""
    found = []
    for path in sorted(REPO_ROOT.glob("notebooks/**/*.ipynb")):
        for cell in _cells(path):
            source = _source(cell)
            if source.startswith("%%writefile") and "init_process_group" in source:
                found.append((f"{path.name}: {source.splitlines()[0].split()[-1]}", source))
    return found


def test_every_distributed_script_a_notebook_writes_leaves_past_the_teardown():
    # A rank on gloo that returns through the interpreter's teardown after
    # destroy_process_group is aborted now and then ("terminate called without an active
    # exception"): chapter 5 explains, and the package's end_process leaves the same way.
    scripts = _distributed_scripts()
    assert len(scripts) >= 7, [name for name, _ in scripts]
    for name, source in scripts:
        tree = ast.parse(source.split("\n", 1)[1])
        main_block = [node for node in tree.body if isinstance(node, ast.If)
                      and "__main__" in ast.unparse(node.test)]
        if not main_block:  # appended to a file that has one (%%writefile -a)
            continue
        calls = [ast.unparse(n.func) for n in ast.walk(main_block[0]) if isinstance(n, ast.Call)]
        helpers = {f.name for f in tree.body if isinstance(f, ast.FunctionDef)
                   and "os._exit" in ast.unparse(f)}
        assert "os._exit" in calls or helpers & set(calls), f"{name} ends through the teardown"
