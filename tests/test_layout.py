"""The house's shape: no module of the project imports one that imports it back, directly or around a circle (imports
inside functions count too: a reader follows them the same way; those under `if __name__ == "__main__":` are the
program's, run as a script, not the module's); and one cycle reads as plain calls in a few files."""
import ast
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = {"tests", "docs", "build"}


def modules():
    """{dotted name: path} of the project's Python files (tests left out)."""
    found = {}
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith((".", "_")) and d not in SKIP]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                found[dotted] = path
    return found


def imports(path, known):
    """The project's modules that the file at path imports, anywhere in it."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names & known


def circle_from(start, graph):
    """A list of modules start -> ... -> start along graph's edges, or None."""
    stack = [(start, [start])]
    seen = set()
    while stack:
        node, path = stack.pop()
        for nxt in sorted(graph[node]):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def test_no_module_imports_one_that_imports_it_back():
    found = modules()
    graph = {name: imports(path, set(found)) - {name} for name, path in found.items()}
    assert {"engine", "cli", "settings", "request", "server", "cpu.native", "benches.common"} <= set(graph)
    circles = [circle_from(name, graph) for name in sorted(graph)]
    assert not any(circles), " ; ".join(" -> ".join(c) for c in circles if c)


def test_a_circle_is_found_where_there_is_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circle_from("a", graph) == ["a", "b", "c", "a"] and circle_from("d", graph) is None


# ---------------------------------------------------------------- one cycle as plain calls
GPU_FILES = {"scheduler.py", "decode.py", "model.py", "kernels.py"}  # the batch's entry, then the cycle's own
CPU_WING = {os.path.join("cpu", "backend.py"), os.path.join("cpu", "native.py")}


def tiny(seed, backend):
    import model
    c = model.Config(arch="llama", vocab_size=8, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=32,
                     max_seq_len=64)
    m = model.Transformer(c, "cpu", torch.float32, backend)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.8)
    return m


def entered(fn):
    """{(file from the project's root, qualified name)} of the project's functions (tests left out) that fn() enters:
    sys.setprofile's call events."""
    seen = set()
    own = set(modules().values())  # not a virtualenv's packages inside the checkout

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and name in own:
            seen.add((os.path.relpath(name, ROOT), frame.f_code.co_qualname))
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def one_cycle(platform_of, monkeypatch):
    """The functions one Batch.cycle of smc 2x2 enters (its second: the first warms caches) on tiny random models run
    by the backend platforms.py chooses for a CPU device, each platform as its users get it (no Triton interpreter)."""
    import engine
    import kernels
    import scheduler
    monkeypatch.setattr(kernels, "INTERPRET", False)
    backend = platform_of(torch.device("cpu")).backend
    e = engine.Engine.of_models(tiny(0, backend), tiny(1, backend))
    req = e.request([1, 2, 3], method="smc", particles=2, draft_len=2, max_new_tokens=20, seed=0)
    with torch.inference_mode():
        batch = scheduler.Batch(e.load().models, req.shape, 1, 3, req.capacity)
        batch.admit(req)
        batch.cycle()
        return entered(batch.cycle)


def test_a_cycle_on_the_gpu_platform_is_the_cycle_the_model_and_the_kernels():
    """kernels.py's Backend (its references, as on a CPU) runs a cycle in decode.py, model.py and kernels.py, from
    scheduler.py's entry, in at most 40 functions: no method object's call, no loop of the layers in the backend."""
    import platforms
    with pytest.MonkeyPatch.context() as monkeypatch:
        functions = one_cycle(platforms.Gpu, monkeypatch)
    assert {f for f, _ in functions} <= GPU_FILES, sorted(functions)
    assert len(functions) <= 40, sorted(functions)
    assert ("decode.py", "smc_cycle") in functions and ("model.py", "Block.forward") in functions


def test_a_cycle_on_the_cpu_platform_adds_only_the_cpu_wing():
    """The CPU wing's Backend runs the same cycle, its own calls in cpu/backend.py and its compiled code's in
    cpu/native.py: five files beside scheduler.py's entry."""
    import platforms
    with pytest.MonkeyPatch.context() as monkeypatch:
        functions = one_cycle(platforms.Cpu, monkeypatch)
    files = {f for f, _ in functions}
    assert files - {"scheduler.py"} <= (GPU_FILES - {"scheduler.py"}) | CPU_WING, sorted(files)
    assert (os.path.join("cpu", "backend.py"), "Backend.layer") in functions
