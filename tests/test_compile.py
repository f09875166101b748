"""Every Triton kernel compiled for the GPUs users have (sm_80, sm_90, gfx942) with the launches the engine makes at
the shapes a GPU run uses: each compiles, its shared memory fits, the default (bf16) path spills nothing. Compiled,
not run: kernels.py's own launchers run on meta tensors, and a plain process compiles what the disk cache lacks."""
import contextlib
import functools
import hashlib
import inspect
import io
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch

import kernels
from benches.common import SHAPES

# Every kernel compiled for three GPU targets: minutes on a fresh cache, so the fast tier leaves it out.
pytestmark = [pytest.mark.skipif(kernels.triton is None, reason="no triton"), pytest.mark.slow]
# name: (backend, arch, warp size, shared memory one program may use: the opt-in maximum)
TARGETS = {"sm_80": ("cuda", 80, 32, 166912), "sm_90": ("cuda", 90, 32, 232448), "gfx942": ("hip", "gfx942", 64, 65536)}
NO_SPILLS = ("sm_80", "sm_90")  # where the bf16 path must not spill
# Qwen2.5-1.5B and -0.5B (the default Coder pair's shapes), as benches/common.py's SHAPES: vocab, dim, layers,
# query heads, kv heads, head dim, ffn dim, tied embeddings, architecture
QWEN = {"qwen-1.5b": (151936, 1536, 28, 12, 2, 128, 8960, True, "qwen2"),
        "qwen-0.5b": (151936, 896, 24, 14, 2, 64, 4864, True, "qwen2")}
MODELS = SHAPES | QWEN
# (target, draft, activations dtype, weight formats, slots, prompt tokens, suffix capacity): sampled, so that the
# first run stays short; each distinct specialisation compiles once whichever workloads reach it
PAIRS = [("llama-8b", "llama-1b", torch.bfloat16, ("bf16", "int4"), 8, 4000, 512),
         ("qwen-1.5b", "qwen-0.5b", torch.bfloat16, ("int8",), 1, 256, 256),
         ("llama-8b", "llama-1b", torch.float32, ("float32", "int4", "int8"), 4, 256, 256),
         ("qwen3-8b", "qwen3-0.6b", torch.bfloat16, ("bf16",), 4, 1024, 256),
         ("qwen3-8b", "qwen3-0.6b", torch.float32, ("float32",), 1, 256, 64),
         ("tiny", "tiny2", torch.float32, ("float32",), 1, 100, 64)]
# method, particles, draft length, racer's tree nodes (0: no racer; a chain of K is a tree of K nodes)
METHODS = [("ar", 1, 1, 0), ("sd", 1, 4, 0), ("easd", 1, 4, 0), ("mdsd", 4, 4, 0), ("smc", 4, 4, 0),
           ("racer", 1, 4, 4), ("racer", 1, 4, 16)]
CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "smcsd-mini", "compile")
KERNELS = ("_attention_split_kernel", "_merge_kernel", "_vocab_chunk_kernel", "_resample_kernel", "_gather_kernel",
           "_quantized_matmul_kernel", "_rms_norm_kernel", "_rope_kernel", "_silu_mul_kernel")


# ---------------------------------------------------------------- the engine's launches, on meta tensors
def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


class Recorder:
    """Stands in for a kernel: each launch's arguments and options, with the workload's label, into `log`."""

    def __init__(self, name, log, label):
        self.name, self.log, self.label = name, log, label

    def __getitem__(self, grid):
        return lambda *args, **options: self.log.append((self.name, args, options, self.label[0]))


def forward(c, R, N, T, caps, dtype, fmt, tree=False, head_rows=None):
    """One model step over [R, N, T] tokens: a layer's attention passes and matmuls (every layer launches the same)."""
    V, dim, _, Hq, Hkv, D, ffn, _, _ = c
    kernels.particle_attention(meta(R, N, T, Hq, D, dtype=dtype), *[meta(R, Hkv, caps[0], D, dtype=dtype)] * 2,
                               *[meta(R, N, Hkv, caps[1], D, dtype=dtype)] * 2, meta(R, dtype=torch.int32),
                               meta(R, dtype=torch.int32), D ** -0.5, meta(R, T, T, dtype=torch.bool) if tree else None)
    glue(c, R * N * T, dtype)
    matmuls(c, R * N * T, head_rows or R * N * T, dtype, fmt)


def glue(c, rows, dtype):
    """A layer's norms (one after the residual add), its RoPE (qwen3: after q's and k's head norms) and its SwiGLU gate
    over `rows` rows."""
    V, dim, _, Hq, Hkv, D, ffn, _, arch = c
    x = meta(rows, dim, dtype=dtype)
    norm = meta(dim, dtype=dtype)
    kernels.rms_norm(x, norm, 1e-6)
    kernels.add_rms_norm(x, x, norm, 1e-6)
    qkv = meta(rows, (Hq + 2 * Hkv) * D, dtype=dtype)
    if arch == "qwen3":
        kernels.qk_norm_rope(qkv, meta(rows, D), meta(rows, D), Hq, Hkv, meta(2 * D, dtype=dtype), 1e-6)
    else:
        kernels.rope(qkv, meta(rows, D), meta(rows, D), Hq + Hkv)
    kernels.silu_mul(meta(rows, 2 * ffn, dtype=dtype))


def matmuls(c, rows, head_rows, dtype, fmt):
    """A block's weight matmuls and the head, in a quantized format (the others are torch's)."""
    V, dim, _, Hq, Hkv, D, ffn, _, _ = c
    if fmt not in ("int8", "int4"):
        return
    for out, inp, M in (((Hq + 2 * Hkv) * D, dim, rows), (dim, Hq * D, rows), (2 * ffn, dim, rows), (dim, ffn, rows),
                        (V, dim, head_rows)):
        q = meta(out, inp, dtype=torch.int8) if fmt == "int8" else meta(out, inp // 2, dtype=torch.uint8)
        scale = meta(out, dtype=dtype) if fmt == "int8" else meta(inp // 32, out, 2, dtype=dtype)
        kernels.quantized_matmul(meta(M, inp, dtype=dtype), q, scale)


def sample(rows, V, R):
    kernels.sample(meta(rows, V), meta(R), meta(R, 2, dtype=torch.int64))


def prefill(t, d, dtype, fmt, N, prompt):
    """A slot's prefill: both models' glue and matmuls over the prompt (attention: torch's), the first token's draw."""
    glue(t, prompt, dtype)
    glue(d, prompt - 1, dtype)
    matmuls(t, prompt, 1, dtype, fmt)
    matmuls(d, prompt - 1, 1, dtype, fmt)
    sample(N, t[0], 1)


def cycle(t, d, dtype, fmt, R, caps, method, N, K, tree):
    """One decoding cycle of `method`: the draft's steps, the target's verify, the rule's draws, smc's resampling."""
    V = t[0]
    if method == "ar":
        forward(t, R, 1, 1, caps, dtype, fmt)
        sample(R, V, R)
        return
    if method == "racer":
        forward(t, R, 1, tree + 1, caps, dtype, fmt, tree=True)
        sample(R * (tree + 1), V, R)
        return
    for T in (2, 1):  # the first draft step also writes the last cycle's pending token
        forward(d, R, N, T, caps, dtype, fmt, head_rows=R * N)
        sample(R * N, V, R)
    forward(t, R, N, K + 1, caps, dtype, fmt)
    if method != "smc":
        sample(R * N, 2, R)  # bernoulli's accept draws
        sample(R, V, R)  # the correction or bonus
        return
    kernels.token_logprobs(meta(R * N * K, V), meta(R * N * K, dtype=torch.int64), meta(R))
    sample(R * N, V, R)
    kernels.resample(meta(R, N), 0.5, meta(R, 2, dtype=torch.int64))
    sample(R, N, R)  # the lag's forced draw
    for c in (t, d):
        kernels.gather_suffix(meta(c[2], R, N, c[4], caps[1], c[5], dtype=dtype), meta(R, N, dtype=torch.int64),
                              meta(R, dtype=torch.int32))
    kernels.gather_suffix(meta(R, N, 1 + caps[1], dtype=torch.int64), meta(R, N, dtype=torch.int64),
                          meta(R, dtype=torch.int32))


def launches(smem):
    """[(kernel, args, options, workload)] of every workload's prefill and cycles, for a program's shared memory.
    A workload reads `activations weights target:draft method NxK [tree T] R=slots`."""
    log, label = [], [""]
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name in KERNELS:
            monkeypatch.setattr(kernels, name, Recorder(name, log, label))
        monkeypatch.setattr(kernels, "launch_target", lambda t: smem)
        monkeypatch.setattr(kernels, "INTERPRET", True)  # meta tensors take the Triton launchers on a GPU machine too
        for target, draft, dtype, formats, R, prompt, suffix in PAIRS:
            t = MODELS[target]
            d = MODELS[draft]
            caps = (prompt, suffix)
            for fmt in formats:
                for method, N, K, tree in METHODS:
                    label[0] = f"{str(dtype)[6:]} {fmt} {target}:{draft} {method} {N}x{K}" \
                        f"{f' tree {tree}' * bool(tree)} R={R}"
                    prefill(t, d, dtype, fmt, N, prompt)
                    cycle(t, d, dtype, fmt, R, caps, method, N, K, tree)
    return log


# ---------------------------------------------------------------- specialisations, as Triton's binder makes them
class Pointer:
    """A tensor as the binder sees it: a dtype and an address (aligned as a view's offset leaves it)."""

    def __init__(self, t):
        self.dtype, self.address = t.dtype, t.storage_offset() * t.element_size()

    def data_ptr(self):
        return self.address


@functools.cache
def source(name):
    """The kernel's source and that of the @jit helpers it calls: what its compiled code depends on."""
    text = inspect.getsource(getattr(kernels, name).fn)
    helpers = [inspect.getsource(f.fn) for n, f in vars(kernels).items() if hasattr(f, "fn") and n != name and
               f"{n}(" in text]
    return text + "".join(helpers)


@functools.cache
def binder(name, target):
    """-> (the kernel as a compilable JITFunction, the target's backend, Triton's binder of its arguments)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature
    fn = JITFunction(getattr(kernels, name).fn)
    backend = make_backend(GPUTarget(*TARGETS[target][:3]))
    return fn, backend, create_function_from_signature(fn.signature, fn.params, backend)


def config(launch):
    """A launch's configuration: its kernel, pointer dtypes, constexprs and options. One launch of each is compiled:
    launches that differ only in scalars (Triton's divisibility-by-16 and value-1 specialisations) share its code's
    tiles, so its registers, shared memory and spills."""
    name, args, options, _ = launch
    return name, tuple(a.dtype for a in args if torch.is_tensor(a)), tuple(sorted(options.items()))


def specialise(launch, target):
    """-> (the compile job of one launch on target, its cache key)."""
    name, args, options, _ = launch
    fn, backend, bind = binder(name, target)
    args = [Pointer(a) if torch.is_tensor(a) else a for a in args]
    bound, spec, binder_options = bind(*args, **options)
    _, signature, constexprs, attrs = fn._pack_args(backend, options, bound, spec, binder_options)
    job = {"kernel": name, "target": target, "signature": signature,
           "constexprs": [[list(k), v] for k, v in sorted(constexprs.items())],
           "attrs": [[list(k), v] for k, v in sorted(attrs.items()) if v],
           "options": {k: options[k] for k in ("num_warps", "num_stages") if k in options}}
    key = hashlib.sha256(json.dumps([source(name), kernels.triton.__version__, job]).encode()).hexdigest()[:24]
    return job, key


@pytest.fixture(scope="module")
def compiled():
    """{key: (job, result, {workloads})} over every target: results from the disk cache, the rest compiled now."""
    found = {}
    for target, (_, _, _, smem) in TARGETS.items():
        configs = {}
        for launch in launches(smem):
            configs.setdefault(config(launch), (launch, set()))[1].add(launch[3])
        for launch, workloads in configs.values():
            job, key = specialise(launch, target)
            found.setdefault(key, (job, set()))[1].update(workloads)
    todo = {key: job for key, (job, _) in found.items() if not os.path.exists(os.path.join(CACHE, key + ".json"))}
    compile_jobs(todo)
    results = {key: json.load(open(os.path.join(CACHE, key + ".json"))) for key in found}
    return {key: (job, results[key], workloads) for key, (job, workloads) in found.items()}


def compile_jobs(todo):
    """Compile jobs {key: job} in plain processes (one per core), each result into the cache as key.json."""
    if not todo:
        return
    os.makedirs(CACHE, exist_ok=True)
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {
        "TRITON_DEFAULT_FP_FUSION": "1", "PYTHONPATH": os.pathsep.join([os.path.dirname(tests), tests])}
    workers, keys = min(os.cpu_count() or 1, len(todo)), sorted(todo)
    with tempfile.TemporaryDirectory() as folder:
        runs = []
        for w in range(workers):
            path = os.path.join(folder, f"{w}.json")
            json.dump({key: todo[key] for key in keys[w::workers]}, open(path, "w"))
            command = f"import test_compile; test_compile.main({path!r}, {CACHE!r})"
            runs.append(subprocess.Popen([sys.executable, "-c", command], env=env, stderr=subprocess.PIPE, text=True))
        for run in runs:
            _, err = run.communicate()
            assert run.returncode == 0, err[-3000:]


def report(compiled, keep):
    """Lines `kernel target: regs, shared, spills  (workloads)` of the results that keep(job, result) selects."""
    rows = []
    for job, result, workloads in compiled.values():
        if keep(job, result, workloads):
            example = sorted(workloads)[0]
            rows.append(f"{job['kernel']} {job['target']} {describe(job)}: {result}  e.g. {example} "
                        f"(+{len(workloads) - 1} workloads)")
    return sorted(rows)


def describe(job):
    """The job's constexprs by name, its warps and stages."""
    names = list(job["signature"])
    consts = {names[k[0]]: v for k, v in job["constexprs"] if job["signature"][names[k[0]]] == "constexpr"}
    return " ".join(f"{k}={v}" for k, v in consts.items() if k.isupper()) + \
        "".join(f" {k}={v}" for k, v in job["options"].items())


def default_path(workloads):
    """Whether a workload of the default GPU configuration (bf16 activations) launches the specialisation."""
    return any(w.startswith("bfloat16 ") for w in workloads)


# ---------------------------------------------------------------- the tests
def test_the_engines_launches_reach_every_kernel_and_method():
    """The workloads launch every kernel, each method's cycle differently (shapes as the engine sends them), qwen3's
    RoPE after its head norms."""
    log = launches(TARGETS["sm_90"][3])
    assert {launch[0] for launch in log} == set(KERNELS)
    assert {launch[3].split()[3] for launch in log} == {m[0] for m in METHODS}
    trees = [launch for launch in log if launch[0] == "_attention_split_kernel" and launch[2]["TREE"]]
    assert trees and all("racer" in launch[3] for launch in trees)
    normed = [launch for launch in log if launch[0] == "_rope_kernel" and launch[2]["NORM"]]  # q/k head norms
    assert normed and all("qwen3" in launch[3] for launch in normed)


def test_interpreted_kernels_compile_in_a_plain_process():
    """Under the interpreter (the suite) kernels are interpreter objects, whose `triton.language` cannot compile;
    their source compiles in a process without TRITON_INTERPRET, as a GPU user's would."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert not hasattr(kernels._resample_kernel, "cache_key")
    job, key = specialise(("_resample_kernel", (meta(1, 4), meta(1, 2, dtype=torch.int64),
                                                 meta(1, 4, dtype=torch.int64), meta(1), meta(1, dtype=torch.bool),
                                                 meta(1, dtype=torch.bool), 4, 1.0), {"BLOCK": 4}, ""), "sm_90")
    assert job["signature"]["logw_ptr"] == "*fp32" and job["signature"]["BLOCK"] == "constexpr"
    compile_jobs({key: job} if not os.path.exists(os.path.join(CACHE, key + ".json")) else {})
    result = json.load(open(os.path.join(CACHE, key + ".json")))
    assert result["error"] is None and result["regs"] > 0


def test_every_launch_compiles_for_every_target(compiled):
    failed = report(compiled, lambda job, result, workloads: result["error"])
    assert not failed, "\n".join(failed)


def test_shared_memory_fits_every_target(compiled):
    """What a program allocates fits its target's per-program shared memory (OutOfResources at launch otherwise)."""
    over = report(compiled, lambda job, result, workloads: result["shared"] > TARGETS[job["target"]][3])
    assert not over, "\n".join(over)


def test_the_default_path_spills_nothing(compiled):
    """bf16 activations (the GPU default, its quantized weights too) spill no register on sm_80 or sm_90."""
    spills = report(compiled, lambda job, result, workloads: job["target"] in NO_SPILLS and result["spill"] and
                    default_path(workloads))
    assert not spills, "\n".join(spills)


def test_spills_elsewhere_are_reported(compiled):
    """Spills off the default path are where they are expected (float32 activations, gfx942's scratch), and are
    reported by name."""
    spilled = [(job, workloads) for job, result, workloads in compiled.values() if result["spill"]]
    spills = report(compiled, lambda job, result, workloads: result["spill"])
    print(f"\n{len(compiled)} specialisations compiled; spills off the default path:", *spills, sep="\n")
    assert all(job["target"] == "gfx942" or not default_path(workloads) for job, workloads in spilled)
    assert sorted(line.split()[0] for line in spills) == sorted(job["kernel"] for job, _ in spilled)


def resources_table(compiled):
    """-> the lines of a markdown table: each kernel configuration's registers, shared memory (bytes a program) and
    spills (bytes a thread; gfx942: scratch) on sm_90, sm_80 and gfx942, compiled, not run."""
    rows = {}
    for job, result, workloads in compiled.values():
        dtypes = "/".join(sorted({v[1:] for v in job["signature"].values() if v.startswith("*")}))
        rows.setdefault((job["kernel"], describe(job), dtypes), {})[job["target"]] = (result, workloads)
    lines = ["| kernel | launch | pointers | sm_90 | sm_80 | gfx942 | e.g. |", "|---|---|---|---|---|---|---|"]
    for (kernel, launch, dtypes), by_target in sorted(rows.items()):
        cells = [f"{r['regs']} / {r['shared']} / {r['spill']}" if (r := by_target.get(t, (None,))[0]) else "-"
                 for t in TARGETS]
        example = sorted(next(iter(by_target.values()))[1])[0]
        lines.append(f"| {kernel} | {launch} | {dtypes} | {' | '.join(cells[1:2] + cells[:1] + cells[2:])} | "
                     f"{example} |")
    return lines


def test_resources_table(compiled):
    """The resources table (`python -m pytest -q -s tests/test_compile.py -k table` prints it): a row per kernel
    configuration, every kernel in it, each target's cell registers / shared / spills of a compiled program."""
    lines = resources_table(compiled)
    print("", *lines, sep="\n")
    rows = [line.split(" | ") for line in lines[2:]]
    assert {row[0].removeprefix("| ") for row in rows} == set(KERNELS)
    assert all(len(row) == 7 for row in rows)
    cells = [cell for row in rows for cell in row[3:6] if cell != "-"]
    assert cells and all(int(cell.split(" / ")[0]) > 0 for cell in cells)


# ---------------------------------------------------------------- the compiling process
def compile_one(job):
    """-> {regs, shared, spill (bytes a thread: ptxas's spill stores, or the AMD scratch), stack, error} of a job."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    backend, arch, warp, _ = TARGETS[job["target"]]
    source_ = ASTSource(getattr(kernels, job["kernel"]), job["signature"],
                        {tuple(k): v for k, v in job["constexprs"]}, {tuple(k): v for k, v in job["attrs"]})
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            k = triton.compile(source_, target=GPUTarget(backend, arch, warp), options=job["options"])
    except Exception as e:  # a compile error is the test's finding, reported with the job
        return {"regs": 0, "shared": 0, "spill": 0, "stack": 0, "error": f"{type(e).__name__}: {str(e)[-2000:]}"}
    if backend == "cuda":
        text = log.getvalue()
        number = lambda pattern: int(re.search(pattern, text).group(1))  # noqa: E731
        return {"regs": number(r"Used (\d+) registers"), "shared": k.metadata.shared,
                "spill": number(r"(\d+) bytes spill stores"), "stack": number(r"(\d+) bytes stack frame"),
                "error": None}
    text = k.asm["amdgcn"]
    number = lambda pattern: int(re.search(pattern, text).group(1))  # noqa: E731
    return {"regs": number(r"\.vgpr_count:\s+(\d+)"), "shared": k.metadata.shared,
            "spill": number(r"; ScratchSize: (\d+)"), "stack": number(r"\.vgpr_spill_count:\s+(\d+)"), "error": None}


def main(jobs_path, cache):
    """Compile the jobs of jobs_path ({key: job}) into cache/key.json, ptxas's log (registers, spills) captured."""
    from triton import knobs
    knobs.nvidia.dump_ptxas_log = True
    with tempfile.TemporaryDirectory() as scratch:
        knobs.cache.dir = scratch  # Triton's own cache would skip ptxas, and its log
        for key, job in json.load(open(jobs_path)).items():
            result = compile_one(job)
            with open(os.path.join(cache, key + ".json.part"), "w") as f:
                json.dump(result, f)
            os.replace(os.path.join(cache, key + ".json.part"), os.path.join(cache, key + ".json"))

