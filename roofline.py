"""The roofline on paper: each method's ideal tokens/s on a named GPU, from the bytes and FLOPs its cycle moves.
A prediction from published peaks, not a measurement: `python roofline.py --gpu h200`. Beside it the measured
side's two numbers, which server.py's watch page sets a cycle's time against: the bytes a real cycle reads from
memory, and the machine's copy bandwidth.
"""
import argparse
import time
from dataclasses import dataclass

import torch

import methods
import model
import scheduler

# Published peaks: HBM bandwidth and dense bf16 tensor-core throughput (no sparsity).
GPUS = {
    "h100": ("NVIDIA H100 SXM", 3.35e12, 989e12),
    "h200": ("NVIDIA H200 SXM", 4.8e12, 989e12),
    "a100": ("NVIDIA A100 SXM 80GB", 2.039e12, 312e12),
}
BF16 = 2  # bytes a weight or cache element


@dataclass(frozen=True)
class Shape:
    """A Llama-family model's sizes and architecture, as benches/common.py's SHAPES write them (a qwen3's head norms
    are too small to count)."""
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool
    arch: str

    def matmul_params(self):
        """Weights every forward multiplies by (the embedding table is only indexed, unless it is the head too)."""
        attention = self.dim * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * self.dim
        ffn = 3 * self.dim * self.ffn
        return self.layers * (attention + ffn) + self.vocab * self.dim

    def kv_bytes_per_token(self):
        return 2 * self.layers * self.kv_heads * self.head_dim * BF16


def forward_seconds(shape, rows, context, particles, gpu):
    """One forward over `rows` new tokens: the larger of its memory time (every weight once, the prompt's K/V once,
    each particle's private K/V) and its compute time (matmuls, and attention over `context` positions)."""
    _, bandwidth, flops = GPUS[gpu]
    prompt_len, suffix_len = context
    read = shape.matmul_params() * BF16 + shape.kv_bytes_per_token() * (prompt_len + particles * suffix_len)
    attention = 4 * rows * (prompt_len + suffix_len) * shape.heads * shape.head_dim * shape.layers
    work = 2 * shape.matmul_params() * rows + attention
    return max(read / bandwidth, work / flops)


def sd_tokens(acceptance, draft_len):
    """Expected tokens a cycle emits when each draft token is accepted with chance a, K accepted adding the bonus:
    the sum over depths of the chance to reach it. mdsd's N drafts accept at least this much."""
    return sum(acceptance ** k for k in range(draft_len + 1))


def predict(method, draft, target, particles, draft_len, context, gpu, acceptance):
    """-> (tokens a cycle emits, seconds a cycle takes) for one request; context = (prompt length, mean suffix)."""
    kind = methods.METHODS[method]
    if not kind.draft_model:
        return 1.0, forward_seconds(target, 1, context, 1, gpu)
    drafting = draft_len * forward_seconds(draft, particles, context, particles, gpu)
    verifying = forward_seconds(target, particles * (draft_len + 1), context, particles, gpu)
    if kind.weighted:  # smc keeps every draft token
        tokens = draft_len + 1.0
    else:
        tokens = sd_tokens(acceptance, draft_len)
    return tokens, drafting + verifying


def table(draft, target, gpu, context, acceptance, cells):
    """Rows (method, N, K, tokens a cycle, cycle ms, tok/s, ratio to ar) in markdown."""
    name, bandwidth, flops = GPUS[gpu]
    _, ar_seconds = predict("ar", draft, target, 1, 1, context, gpu, acceptance)
    lines = [f"Predicted on paper for {name} ({bandwidth / 1e12:.2f} TB/s, {flops / 1e12:.0f} TFLOP/s bf16 dense), "
             f"prompt {context[0]} tokens, mean generated length {context[1]}, {acceptance} of sd's draft tokens "
             "accepted (mdsd: the same, a lower bound):",
             "", "| method | N | K | tokens/cycle | cycle ms | tok/s | vs ar |", "|---|---|---|---|---|---|---|"]
    for method, particles, draft_len in cells:
        tokens, seconds = predict(method, draft, target, particles, draft_len, context, gpu, acceptance)
        rate = tokens / seconds
        lines.append(f"| {method} | {particles} | {draft_len} | {tokens:.2f} | {1e3 * seconds:.2f} | {rate:.0f} | "
                     f"{rate * ar_seconds:.2f}x |")
    return "\n".join(lines)


# ---------------------------------------------------------------- measured: the bytes a cycle reads, the bandwidth


def kv_bytes_per_token(m):
    """One token's K and V in every layer of model m, in its activations' dtype."""
    return model.KVCache.nbytes(m.config, 1, 1, 0, m.embed.dtype)


def cycle_reads(target, draft, draft_steps, particles, prompt_len, suffix_len):
    """-> {"weights": bytes, "kv": bytes} one request's cycle reads: every weight once a forward (a forward over
    many rows reads each weight once) and the KV cache, the prompt once and each particle's suffix; draft_steps
    forwards of the draft (K; none for ar and racer's drafts), then one of the target."""
    forwards = [target] + [draft] * draft_steps
    kv = sum(kv_bytes_per_token(m) for m in forwards) * (prompt_len + particles * suffix_len)
    return {"weights": sum(m.weight_bytes() for m in forwards), "kv": kv}


def copy_bandwidth(device, repeats=5):
    """GB/s of a large tensor copy (bytes read + written), the best of a few: the machine's practical memory
    bandwidth, measured in the same process as the decoding it is set against."""
    elements = 2**27  # 256 MiB in bf16; twice that on a GPU
    if device.type == "cuda":
        elements = 2**28
    src = torch.ones(elements, device=device, dtype=torch.bfloat16)  # written: no page reads as the zero page
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        scheduler.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        scheduler.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best / 1e9


CELLS = (("ar", 1, 1), ("sd", 1, 4), ("mdsd", 4, 4), ("smc", 4, 4), ("smc", 8, 8), ("smc", 16, 4))


def main(argv=None):
    from benches import common  # the shapes bench.py runs with random weights

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu", choices=sorted(GPUS), default="h200")
    p.add_argument("--pair", default="llama-1b:llama-8b", help="draft:target, names of benches/common.py's SHAPES")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--acceptance", type=float, default=0.7, help="sd's and mdsd's chance a draft token is accepted")
    args = p.parse_args(argv)
    draft_name, target_name = args.pair.split(":")
    draft = Shape(*common.SHAPES[draft_name])
    target = Shape(*common.SHAPES[target_name])
    context = (args.prompt_len, args.new_tokens // 2)
    print(table(draft, target, args.gpu, context, args.acceptance, CELLS))


if __name__ == "__main__":
    main()
