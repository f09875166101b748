"""The CPU backend's attention paths (cpu/backend.py) against plain references: particle_attention_cpu (torch's
fused CPU attention, prefix and suffix merged by log-sum-exp) with GQA groupings, several particle / token /
prompt / suffix sizes and per-request lengths; prefill_attention's blocked CPU path across block boundaries."""
import pytest
import torch
import torch.nn.functional as F

import kernels
from cpu import backend as cpu_backend


def inputs(R, N, T, Hq, Hkv, D, prefix_len, suffix_len, dtype, seed=0):
    """Random q and caches with room past every length, filled with noise there: a row that reads past its
    lengths shows up as a mismatch."""
    g = torch.Generator().manual_seed(seed)
    P, S = max(prefix_len) + 5, max(suffix_len) + T + 3
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    q = rand(R, N, T, Hq, D)
    pk, pv = rand(R, Hkv, P, D), rand(R, Hkv, P, D)
    sk, sv = rand(R, N, Hkv, S, D), rand(R, N, Hkv, S, D)
    lengths = [torch.tensor(x, dtype=torch.int32) for x in (prefix_len, suffix_len)]
    return (q, pk, pv, sk, sv, *lengths, D ** -0.5)


CASES = [  # R, N, T, Hq, Hkv, D, prefix_len per request, suffix_len per request
    (1, 1, 1, 12, 2, 128, [100], [0]),  # ar on the Qwen2.5-1.5B shape
    (1, 4, 5, 12, 2, 128, [300], [17]),  # an smc verify, 4 particles x 5 rows
    (1, 2, 5, 14, 2, 64, [33], [6]),  # the 0.5B draft's shape
    (1, 4, 2, 8, 8, 32, [9], [40]),  # no GQA
    (1, 3, 3, 4, 1, 16, [1], [0]),  # one KV head, a one-token prompt
    (2, 2, 4, 6, 2, 16, [7, 50], [12, 0]),  # requests of their own lengths
    (2, 3, 1, 4, 2, 16, [0, 20], [3, 5]),  # an empty prefix: the draft of a one-token prompt
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: str(c[:6]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(case, dtype):
    args = inputs(*case, dtype=dtype)
    out = cpu_backend.particle_attention_cpu(*args)
    assert out.shape == args[0].shape and out.dtype == dtype
    exact = kernels.particle_attention_ref(*(a.float() if a.is_floating_point() else a for a in args[:7]), args[7])
    if dtype == torch.float32:
        torch.testing.assert_close(out, exact, atol=1e-5, rtol=1e-5)
    else:  # no worse than the bf16 reference, which rounds scores and probabilities to bf16
        ref_error = (kernels.particle_attention_ref(*args).float() - exact).abs().max()
        assert (out.float() - exact).abs().max() <= ref_error


def test_the_new_tokens_see_the_rows_before_them_only():
    """Changing the suffix at a new token's own row changes that token's output and those after it, never those
    before it: the causal block of the T new tokens."""
    q, pk, pv, sk, sv, plen, slen, scale = inputs(1, 2, 4, 4, 2, 16, [10], [3], torch.float32)
    before = cpu_backend.particle_attention_cpu(q, pk, pv, sk, sv, plen, slen, scale)
    sv[0, 1, :, 3 + 2] += 1.0  # particle 1, new token 2
    after = cpu_backend.particle_attention_cpu(q, pk, pv, sk, sv, plen, slen, scale)
    changed = (after - before).abs().amax((-1, -2))[0]  # [N, T]
    assert changed[0].max() == 0 and changed[1, :2].max() == 0 and changed[1, 2:].min() > 0


def test_the_cpu_backend_uses_it_where_the_compiled_kernel_does_not_serve():
    """bf16 rows, and a request beyond native.SMALL_ATTENTION's rows x keys."""
    backend = cpu_backend.Backend()
    small = inputs(1, 2, 3, 4, 2, 16, [8], [2], torch.bfloat16)
    large = inputs(1, 4, 5, 4, 2, 16, [900], [2], torch.float32)
    for args in (small, large):
        assert torch.equal(backend.particle_attention(*args), cpu_backend.particle_attention_cpu(*args))


@pytest.mark.parametrize("T, Hq, Hkv, D", [(1, 4, 2, 16), (37, 12, 2, 32), (300, 4, 1, 16), (600, 8, 8, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_matches_sdpa(T, Hq, Hkv, D, dtype):
    """300 and 600 tokens span several query blocks."""
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(T, h, D, generator=g).to(dtype) for h in (Hq, Hkv, Hkv))
    out = cpu_backend.prefill_attention(q, k, v, 0.3)
    exact = F.scaled_dot_product_attention(*(x.double().transpose(0, 1) for x in (q, k, v)), is_causal=True,
                                           scale=0.3, enable_gqa=True).transpose(0, 1)
    assert out.shape == q.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), exact, atol=tol, rtol=tol)
