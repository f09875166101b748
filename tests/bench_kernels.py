"""GPU micro-benchmark (python tests/bench_kernels.py, after tests/test_kernels.py): each Triton kernel against its
PyTorch reference on engine-sized shapes, attention's achieved bandwidth against a device-to-device copy, as a
markdown table; without CUDA it says so and exits."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kernels  # noqa: E402

DEVICE = "cuda"
# Qwen2.5-1.5B as the target; smc's particles and draft tokens
N = 8  # particles
K = 4  # draft tokens per cycle
HQ = 12  # query heads
HKV = 2  # KV heads
D = 128  # head dim
V = 151936  # vocabulary
LAYERS = 28
CACHE = 2048  # suffix cache tokens
ATTENTION = [(1, 512, 128), (K + 1, 512, 128), (K + 1, 4096, 512), (K + 1, 16384, 1024)]  # T, prompt, generated


def milliseconds(fn):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=200)


def copy_bandwidth():
    """Device memory bandwidth in GB/s, as a large tensor copy achieves it (read + write)."""
    src = torch.empty(2**28, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / milliseconds(lambda: dst.copy_(src)) / 1e6


def attention_case(T, prompt, generated):
    """Inputs for one layer's particle attention, and the bytes it must read and write."""
    prefix_cap = prompt + 64
    suffix_cap = generated + 256
    rand = lambda *shape: torch.randn(*shape, dtype=torch.bfloat16, device=DEVICE)  # noqa: E731
    q = rand(1, N, T, HQ, D)
    prefix_k = rand(1, HKV, prefix_cap, D)
    prefix_v = rand(1, HKV, prefix_cap, D)
    suffix_k = rand(1, N, HKV, suffix_cap, D)
    suffix_v = rand(1, N, HKV, suffix_cap, D)
    lengths = [torch.tensor([n], dtype=torch.int32, device=DEVICE) for n in (prompt, generated)]
    args = (q, prefix_k, prefix_v, suffix_k, suffix_v, *lengths, D ** -0.5)
    kv_bytes = 2 * HKV * D * 2 * (prompt + N * (generated + T))
    return args, kv_bytes + 2 * q.nbytes


def cases():
    """(kernel, shape, Triton call, reference call, bytes it must move or None)."""
    for T, prompt, generated in ATTENTION:
        args, nbytes = attention_case(T, prompt, generated)
        yield ("particle_attention", f"N={N} T={T} prompt={prompt} generated={generated}",
               lambda: kernels.particle_attention(*args), lambda: kernels.particle_attention_ref(*args), nbytes)
    rng = kernels.make_rng(0, DEVICE)
    for B in (N, N * (K + 1)):
        logits = torch.randn(B, V, dtype=torch.bfloat16, device=DEVICE)
        tokens = torch.randint(0, V, (B,), device=DEVICE)
        yield ("sample", f"B={B} V={V}", lambda: kernels.sample(logits, 0.7, rng),
               lambda: kernels.sample_ref(logits, 0.7, rng), logits.nbytes)
        yield ("token_logprobs", f"B={B} V={V}", lambda: kernels.token_logprobs(logits, tokens, 0.7),
               lambda: kernels.token_logprobs_ref(logits, tokens, 0.7), logits.nbytes)
    R = 4  # batched requests, each with its own seed and temperature
    B = N * (K + 1)
    logits = torch.randn(R * B, V, dtype=torch.bfloat16, device=DEVICE)
    rngs = kernels.make_rng(list(range(R)), DEVICE)
    temperature = torch.tensor([0.7, 1.0, 0.0, 0.7], device=DEVICE)
    yield ("sample", f"R={R} x B={B} V={V}, T per request", lambda: kernels.sample(logits, temperature, rngs),
           lambda: kernels.sample_ref(logits, temperature, rngs), logits.nbytes)
    for logw, rng in ((torch.randn(1, N, device=DEVICE), rng), (torch.randn(R, N, device=DEVICE), rngs)):
        yield ("resample", f"R={len(logw)} N={N}", lambda: kernels.resample(logw, 0.5, rng),
               lambda: kernels.resample_ref(logw, 0.5, rng), None)
    cache = torch.randn(LAYERS, 1, N, HKV, CACHE, D, dtype=torch.bfloat16, device=DEVICE)
    ancestors = torch.arange(N, device=DEVICE)[None].clone()
    ancestors[0, 1] = 0  # 2 particles move
    ancestors[0, -1] = 0
    length = torch.tensor([CACHE // 2], dtype=torch.int32, device=DEVICE)
    yield ("gather_suffix", f"L={LAYERS} N={N} S={CACHE} length={CACHE // 2}, 2 moved",
           lambda: kernels.gather_suffix(cache, ancestors, length),
           lambda: kernels.gather_suffix_ref(cache, ancestors, length), 2 * 2 * LAYERS * HKV * (CACHE // 2) * D * 2)


def table(copy_gbs):
    lines = [f"device: {torch.cuda.get_device_name()}, copy bandwidth {copy_gbs:.0f} GB/s", "",
             "| kernel | shape | triton us | reference us | speed-up | GB/s | % of copy |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, shape, fn, ref_fn, nbytes in cases():
        ms = milliseconds(fn)
        ref = milliseconds(ref_fn)
        gbs = nbytes / ms / 1e6 if nbytes else None
        bandwidth = f"{gbs:.0f} | {100 * gbs / copy_gbs:.0f}%" if gbs else "- | -"
        lines.append(f"| {name} | {shape} | {1e3 * ms:.1f} | {1e3 * ref:.1f} | {ref / ms:.1f}x | {bandwidth} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if not torch.cuda.is_available() or kernels.triton is None or kernels.INTERPRET:
        sys.exit("bench_kernels: needs a CUDA device and triton, with TRITON_INTERPRET unset")
    print(table(copy_bandwidth()))
