"""Static checks of chapter code that only runs on GPUs (CI has none): the scripts chapter 5
writes with %%writefile, read as Python and checked for what their GPU branches must do."""

import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _written_script(notebook: str, name: str) -> str:
    nb = json.loads((ROOT / "notebooks" / notebook).read_text(encoding="utf-8"))
    for cell in nb["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and source.startswith(f"%%writefile {name}\n"):
            return source.split("\n", 1)[1]
    raise AssertionError(f"{notebook} writes no {name}")


def _function(script: str, name: str) -> ast.FunctionDef:
    for node in ast.walk(ast.parse(script)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"no function {name}")


def test_the_lesson_script_trains_in_strict_fp32_on_gpus_like_the_package():
    # train_ddp(precision="fp32") turns TF32 off; cuDNN's convolutions default to TF32 from
    # Ampere on, so the script must too, or "lesson script = package" is False on a GPU.
    script = _written_script("05_distributed_data_parallel.ipynb", "ddp_script.py")
    body = ast.unparse(_function(script, "train"))
    gpu_branch = body[body.index("if use_gpu:"):body.index("dist.init_process_group")]
    assert "torch.backends.cudnn.conv.fp32_precision = 'ieee'" in gpu_branch


def test_dataparallel_is_timed_on_ddps_gpus_while_the_other_ranks_wait_on_the_host():
    script = _written_script("05_distributed_data_parallel.ipynb", "ddp_details.py")
    body = ast.unparse(_function(script, "dp_against_ddp"))
    # Without device_ids DataParallel spreads over every visible GPU, DDP over `world`.
    assert "nn.DataParallel(" in body and "device_ids=list(range(world))" in body
    # After rank 0's timing, the others wait in a gloo barrier, not an NCCL kernel.
    assert "new_group(backend='gloo')" in body
    last_barrier = body.rindex("dist.barrier(")
    assert body[last_barrier:].startswith("dist.barrier(group=host_group)")


def test_chapter_7_compiles_on_a_gpu_only_where_its_own_check_allows():
    # A P100 (sm_60) raises GPUTooOldForTriton, a Windows wheel TritonMissing: every cell that
    # may compile with inductor asks technique_skip_reason("compile") first. Calls with the
    # eager backend or a backend of the chapter's own (which runs the graph as is) need not.
    nb = json.loads((ROOT / "notebooks" / "07_profiling_and_compile.ipynb").read_text("utf-8"))
    no_inductor = ('backend="eager"', "backend=keep_graphs", "backend=count_graphs")
    checked = 0
    for cell in nb["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] != "code":
            continue
        calls = [source[i:source.find("\n", i)] for i in range(len(source))
                 if source.startswith("torch.compile(", i)]
        inductor = [c for c in calls if not any(b in c for b in no_inductor)]
        if inductor or "compare_compile_modes(" in source:
            checked += 1
            assert 'technique_skip_reason("compile", device)' in source, source[:300]
    assert checked >= 3  # the compile demo, the modes compared, the CUDA-graph step


def _cell_printing(notebook: str, marker: str) -> str:
    nb = json.loads((ROOT / "notebooks" / notebook).read_text(encoding="utf-8"))
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    found = [source for source in cells if marker in source]
    assert len(found) == 1, f"{len(found)} cells of {notebook} contain {marker!r}"
    return found[0]


def test_chapter_5s_dataparallel_or_ddp_verdict_on_both_sides_of_its_margin(capsys):
    # The cell runs only on GPUs; here it reads made-up throughputs (images/s).
    cell = _cell_printing("05_distributed_data_parallel.ipynb", 'details["dp_vs_ddp"]')
    for dp, ddp, verdict in ((100, 115, "faster: DDP, 1.15x"), (100, 105, "faster: neither"),
                             (105, 100, "faster: neither"),
                             (115, 100, "faster: DataParallel, 1.15x")):
        details = {"dp_vs_ddp": {"dp_images_per_s": dp, "ddp_images_per_s": ddp},
                   "world_size": 2}
        exec(cell, {"details": details})
        printed = capsys.readouterr().out
        assert printed.splitlines()[-1].startswith(verdict), (dp, ddp, printed)
