"""The lesson layer stays readable: what a learner reads to follow a helper.

A helper's read depth is its own lines plus those of every lesson-layer definition it names,
and those they name, transitively (a class counts whole; a name counts even on a branch that
never runs). The runtime (``d2lgpu/runtime/``) is neither counted nor followed: a learner
need not read it. The limits are the README's: ``train`` within 300 lines, every helper the
chapters call within 400, and about 50 lines of its own.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "d2lgpu"

#: The deepest helpers the chapters call, by their own module.
DEEP_HELPERS = [
    "fast:train_fast", "ddp_train:train_ddp", "profiling:count_effects", "profiling:run_ablation",
    "profiling:ablation_data", "sharding:FSDPRun", "report:environment_report",
    "precision:precision_sweep", "benchmarking:fusion_study", "profiling:measure_roofline",
    "data:fashion_mnist_on_device", "model_parallel:PipelineRun",
]


def _lesson_definitions() -> tuple[dict, dict]:
    """({"module:name": node}, {module: {alias: (module, name or None)}}) for the lesson
    modules; "module" is the name under d2lgpu ("fast", "runtime.gpus")."""
    definitions, imports = {}, {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)  # "": d2lgpu itself
        if module.startswith("runtime"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        table = imports.setdefault(module, {})
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):  # import d2lgpu, import d2lgpu.x as y
                for alias in node.names:
                    if alias.name.split(".")[0] == "d2lgpu":
                        whole = alias.name.removeprefix("d2lgpu").lstrip(".")
                        table[alias.asname or "d2lgpu"] = (whole if alias.asname else "", None)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("d2lgpu"):
                source = node.module.removeprefix("d2lgpu").lstrip(".")
                for alias in node.names:
                    whole = f"{source}.{alias.name}".lstrip(".")
                    is_module = (PACKAGE / f"{whole.replace('.', '/')}.py").exists()
                    table[alias.asname or alias.name] = (whole, None) if is_module else (
                        source, alias.name)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                definitions[f"{module}:{node.name}"] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for name in (n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)):
                    if name != "__all__":
                        definitions[f"{module}:{name}"] = node
    return definitions, imports


DEFINITIONS, IMPORTS = _lesson_definitions()


def _resolve(module: str, name: str) -> str | None:
    """The lesson definition ``name`` means in ``module`` (through re-exports), or None."""
    for _ in range(5):
        if f"{module}:{name}" in DEFINITIONS:
            return f"{module}:{name}"
        module, name = IMPORTS.get(module, {}).get(name, (None, None))
        if name is None:
            return None
    return None


def _is_module(name: str) -> bool:
    return name == "" or (PACKAGE / f"{name.replace('.', '/')}.py").exists() or (
        PACKAGE / name.replace(".", "/") / "__init__.py").exists()


def _named_in(key: str) -> set[str]:
    module = key.split(":")[0]
    found = set()
    for node in ast.walk(DEFINITIONS[key]):
        if isinstance(node, ast.Name):
            found.add(_resolve(module, node.id))
        elif isinstance(node, ast.Attribute):  # module.name, d2lgpu.sub.name, ...
            chain = []
            while isinstance(node, ast.Attribute):
                chain.insert(0, node.attr)
                node = node.value
            imported = IMPORTS.get(module, {}).get(getattr(node, "id", None))
            if imported and imported[1] is None:
                target = imported[0]
                while chain and _is_module(f"{target}.{chain[0]}".lstrip(".")):
                    target = f"{target}.{chain.pop(0)}".lstrip(".")
                if chain and not target.startswith("runtime"):
                    found.add(_resolve(target, chain[0]))
    return found - {None, key}


def _lines(key: str) -> int:
    node = DEFINITIONS[key]
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return node.end_lineno - start + 1


def read_depth(key: str) -> int:
    seen, stack = {key}, [key]
    while stack:
        for name in _named_in(stack.pop()) - seen:
            seen.add(name)
            stack.append(name)
    return sum(_lines(k) for k in seen)


def test_the_measure_follows_names_through_modules_and_re_exports():
    assert _resolve("", "train") == "training:train"  # d2lgpu.train, re-exported
    assert "training:History" in _named_in("fast:train_fast")
    assert "precision:precision_policy" in _named_in("fast:train_fast")
    # the runtime is left out: train_fast's device check is not counted
    assert not any(k.startswith("runtime") for k in _named_in("fast:train_fast"))
    assert read_depth("training:set_seed") == _lines("training:set_seed")
    assert ":__version__" in _named_in("report:print_setup")  # import d2lgpu; d2lgpu.name


def test_train_reads_in_at_most_300_lines():
    assert read_depth("training:train") <= 300
    assert _lines("training:train") <= 50


@pytest.mark.parametrize("helper", DEEP_HELPERS)
def test_a_helper_the_chapters_call_reads_in_at_most_400_lines(helper):
    assert helper in DEFINITIONS, f"{helper} moved: update DEEP_HELPERS"
    assert read_depth(helper) <= 400
    assert _lines(helper) <= 50
