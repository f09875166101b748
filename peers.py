"""The peers bench.py sets the engine against: transformers' generate (alone with a static cache, assisted by the
draft, batched) on the same prompts and sampling, and llama.cpp itself on the models' GGUF files."""
import os
import statistics
import sys
import time

import torch

import request

HF_GENERATE = "hf generate (static cache)"


# ---------------------------------------------------------------- transformers


def hf_model(path, dtype):
    """A model as transformers reads it, in dtype; a GGUF file through the bf16 directory it is converted to once,
    beside it (weights/fetch.py's conversion: the same values the engine reads from the file)."""
    from transformers import AutoModelForCausalLM

    from weights import fetch
    directory = path.removesuffix(".gguf")
    if directory != path and not os.path.isdir(directory):
        fetch.convert(path, directory)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()


def hf_models(paths, dtype):
    """(draft, target) paths -> (target, draft) as transformers models."""
    draft_path, target_path = paths
    return hf_model(target_path, dtype), hf_model(draft_path, dtype)


def pad_id(e):
    """A real token id to pad transformers' batches with (the engine's own pad lies past the vocabulary)."""
    return (e.config.eos_ids or [0])[0]


def hf_options(pad, temperature):
    """transformers' sampling as the engine's: temperature only, top-k and top-p off."""
    return dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, pad_token_id=pad)


def hf_rows(models, ids_by_prompt, pad, temperature, new_tokens, repeats):
    """transformers' generate on the prompts: the target alone with a static cache, and assisted generation with
    the draft (its default dynamic cache), same dtype, sampling temperature and threads."""
    target, draft = models
    options = hf_options(pad, temperature)
    runners = {HF_GENERATE: dict(cache_implementation="static"), "hf assisted (draft)": dict(assistant_model=draft)}
    rows = []
    for label, extra in runners.items():
        for name, ids in ids_by_prompt.items():
            x = torch.tensor([ids])
            target.generate(x, max_new_tokens=4, **options, **extra)  # warm-up
            rates = []
            for repeat in range(repeats):
                torch.manual_seed(repeat)
                start = time.perf_counter()
                out = target.generate(x, max_new_tokens=new_tokens, **options, **extra)
                rates.append((out.shape[1] - x.shape[1]) / (time.perf_counter() - start))
            rows.append({"prompt": name, "method": label, "tokens_per_s": statistics.median(rates), "runs": rates})
    return rows


def median_run(key, runs):
    """A row from the runs of one (R, method): the median throughput, the other figures from the median run."""
    ordered = sorted(runs, key=lambda run: run["tokens_per_s"])
    return {**key, **ordered[len(ordered) // 2], "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "runs": [r["tokens_per_s"] for r in runs]}


def hf_batch_rows(target, prompts, pad, eos_ids, temperature, concurrency, new_tokens, repeats):
    """transformers' batched generate on the target at each R of concurrency: the first R prompts, padded on the
    left, a static cache, sampling as the engine samples. No min_new_tokens: like the engine, a row ends at its EOS,
    and only its tokens before the EOS count. Every row returns with the whole batch, so each request's latency is
    the call's wall clock."""
    options = hf_options(pad, temperature) | {"cache_implementation": "static", "max_new_tokens": new_tokens}
    rows = []
    for R in concurrency:
        longest = max(len(ids) for ids in prompts[:R])
        x = torch.tensor([[pad] * (longest - len(ids)) + ids for ids in prompts[:R]])
        mask = torch.tensor([[0] * (longest - len(ids)) + [1] * len(ids) for ids in prompts[:R]])
        target.generate(x, attention_mask=mask, **options | {"max_new_tokens": 4})  # warm-up
        runs = []
        for repeat in range(repeats):
            torch.manual_seed(repeat)
            start = time.perf_counter()
            out = target.generate(x, attention_mask=mask, **options)
            seconds = time.perf_counter() - start
            counts = [len(request.until_eos(row, eos_ids)) for row in out[:, longest:].tolist()]
            runs.append({"new_tokens": sum(counts), "seconds": seconds, "tokens_per_s": sum(counts) / seconds,
                         "mean_latency_s": seconds, "max_latency_s": seconds,
                         "request_tokens_per_s": statistics.mean(counts) / seconds,
                         "eos_stops": sum(n < out.shape[1] - longest for n in counts)})
        rows.append(median_run({"R": R, "method": HF_GENERATE, "N": 1, "K": 1}, runs))
    return rows


# ---------------------------------------------------------------- llama.cpp


def gguf_of(path):
    """The GGUF file of a model: itself, or the file a weights/ directory was converted from, beside it; or None."""
    if path.endswith(".gguf"):
        gguf = path
    else:
        gguf = os.path.normpath(path) + ".gguf"
    if os.path.isfile(gguf):
        return gguf
    return None


def check(status):
    if status != 0:
        raise RuntimeError(f"llama_decode returned {status}")


def llama_cpp_bindings():
    """-> (lib, tokens(ids) -> a llama_token array, text(char *) -> str, the package) of llama.cpp's C API: through
    llama-cpp-python (ctypes; built for this CPU where it was installed from source) first, else llama-cpp-cffi (a
    prebuilt library); None where neither is installed, or one that is fails to load (one line on stderr)."""
    os.environ.setdefault("LLAMA_CPP_BACKEND", "cpu")  # not llama-cpp-cffi's CUDA build on a GPU machine
    try:
        import llama_cpp as lib
        return lib, lambda ids: (lib.llama_token * len(ids))(*ids), bytes.decode, "llama-cpp-python"
    except ModuleNotFoundError as error:
        if error.name != "llama_cpp":  # installed, but without a package it imports
            print(f"llama.cpp peer: llama-cpp-python does not import ({error})", file=sys.stderr)
    except (ImportError, OSError) as error:  # installed, but its library does not load (a C++ runtime too old, say)
        print(f"llama.cpp peer: llama-cpp-python's library does not load ({error})", file=sys.stderr)
    try:
        from llama.llama_cpp import ffi, lib
        return lib, lambda ids: ffi.new("llama_token[]", ids), lambda p: ffi.string(p).decode(), "llama-cpp-cffi"
    except ModuleNotFoundError:
        return None
    except (ImportError, OSError) as error:
        print(f"llama.cpp peer left out: llama-cpp-cffi's library does not load ({error})", file=sys.stderr)
        return None


class LlamaCpp:
    """llama.cpp itself on one GGUF file, through llama_cpp_bindings(); `build` says which library and what it was
    built for (its system info: AVX512, AVX512_VNNI, REPACK...). load() -> None where no llama.cpp is at hand."""

    @classmethod
    def load(cls, gguf):
        bindings = llama_cpp_bindings()
        if bindings is None:
            return None
        lib = bindings[0]
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        llama_model = lib.llama_model_load_from_file(gguf.encode(), params)
        if not llama_model:
            print(f"llama.cpp peer left out: it cannot load {gguf}", file=sys.stderr)
            return None
        return cls(bindings, llama_model)

    def __init__(self, bindings, llama_model):
        self.lib, self.tokens, text, package = bindings
        self.model = llama_model
        self.build = f"{package}: {text(self.lib.llama_print_system_info()).strip()}"

    def run(self, ids, temperature, new_tokens, seed):
        """One run on the engine's threads: ids, then new_tokens sampled at temperature (EOS ignored) -> the engine's
        stats' names for it: tokens_per_s from the prefill on, prefill_seconds and first_token_s (to the first token's
        logits), seconds."""
        lib = self.lib
        params = lib.llama_context_default_params()
        params.n_ctx = len(ids) + new_tokens + 1
        params.n_batch = max(len(ids), 1)
        params.n_threads = torch.get_num_threads()
        params.n_threads_batch = torch.get_num_threads()
        ctx = lib.llama_init_from_model(self.model, params)
        sampler = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        lib.llama_sampler_chain_add(sampler, lib.llama_sampler_init_temp(temperature))
        lib.llama_sampler_chain_add(sampler, lib.llama_sampler_init_dist(seed))
        tokens = self.tokens(ids)
        start = time.perf_counter()
        check(lib.llama_decode(ctx, lib.llama_batch_get_one(tokens, len(ids))))
        prefill = time.perf_counter() - start
        for _ in range(new_tokens - 1):  # as the engine's: the prefill's logits draw the first token
            tokens[0] = lib.llama_sampler_sample(sampler, ctx, -1)
            check(lib.llama_decode(ctx, lib.llama_batch_get_one(tokens, 1)))
        lib.llama_sampler_sample(sampler, ctx, -1)
        seconds = time.perf_counter() - start
        lib.llama_sampler_free(sampler)
        lib.llama_free(ctx)
        return {"new_tokens": new_tokens, "tokens_per_s": new_tokens / seconds, "prefill_seconds": prefill,
                "first_token_s": prefill, "seconds": seconds}

    def close(self):
        self.lib.llama_model_free(self.model)


def llama_cpp_rows(paths, ids_by_prompt, temperature, new_tokens, repeats):
    """llama.cpp itself: ar on each model's GGUF file (paths: draft, target), the same prompt ids, temperature,
    new tokens (EOS ignored) and threads, the median of `repeats` -> rows as hf_rows', with the build; none where
    no llama.cpp is at hand."""
    rows = []
    for role, path in zip(("draft", "target"), paths):
        gguf = gguf_of(path)
        peer = gguf and LlamaCpp.load(gguf)
        if not peer:
            continue
        for name, ids in ids_by_prompt.items():
            peer.run(ids, temperature, 4, 0)  # warm-up
            rates = [peer.run(ids, temperature, new_tokens, seed)["tokens_per_s"] for seed in range(repeats)]
            rows.append({"prompt": name, "method": f"llama.cpp ar, the {role} ({os.path.basename(gguf)})",
                         "tokens_per_s": statistics.median(rates), "runs": rates, "build": peer.build})
        peer.close()
    return rows
