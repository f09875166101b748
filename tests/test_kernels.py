"""Each Triton kernel against its PyTorch reference, plus the statistical contracts of sampling and
resampling. Without CUDA the kernels run in the Triton interpreter (tiny shapes: it is slow)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels defines its @triton.jit functions

import math  # noqa: E402

import pytest  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

import kernels  # noqa: E402
from cpu import backend as cpu_backend  # noqa: E402

tl = kernels.tl
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU = cpu_backend.Backend()  # its compiled sampler and log-probs (references where no compiler works)
needs_triton = pytest.mark.skipif(not kernels.use_triton(torch.empty(0, device=DEVICE)),
                                  reason="no triton, or CPU without TRITON_INTERPRET=1 set before import")
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero")  # the interpreter's log2(0) = -inf


def chi2_quantile(df, z=3.09):
    """Wilson-Hilferty approximation of the chi-square quantile; z = 3.09 is p = 0.001."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@kernels.jit
def _offset_probe(out_ptr, stride):
    i = tl.program_id(0)
    tl.store(out_ptr + i, kernels._offset(i, stride))


@needs_triton
def test_offsets_past_2_31_do_not_wrap():
    """In one layer's suffix cache [R, N=16, Hkv=8, S=128k, D=128] the particle stride is 2**27 elements
    (an int32 argument) and the last key of particle 15 sits at 2**31 - 1: a longer S passes it.
    `kernels._offset`, which every program index goes through before meeting a stride, must not wrap."""
    stride = 8 * 2**17 * 128
    out = torch.empty(40, dtype=torch.int64, device=DEVICE)
    _offset_probe[(40,)](out, stride)
    assert out.tolist() == [i * stride for i in range(40)]  # 16 * 2**27 = 2**31; 32 * 2**27 = 2**32


# ---------------------------------------------------------------- attention

CASES = [  # N, T, Hkv, G, D, dtype, prefix lengths, suffix lengths, P, S
    (3, 1, 2, 1, 64, torch.float32, (1, 37), (0, 7), 40, 16),  # 3 prefix splits, empty suffix
    (2, 5, 1, 2, 128, torch.float16, (50,), (7,), 64, 12),  # suffix filled to capacity
    (2, 5, 2, 4, 64, torch.bfloat16, (3,), (0,), 16, 8),
    (2, 5, 1, 7, 64, torch.float32, (90,), (100,), 100, 128),  # 2 prefix splits, 3 suffix splits
    (4, 1, 1, 7, 128, torch.float16, (20, 5), (30, 3), 24, 40),  # 3 suffix splits
    (4, 5, 1, 7, 64, torch.float16, (30,), (6,), 40, 16),  # 140 query rows: 2 row blocks
    (2, 5, 2, 1, 128, torch.float16, (17,), (2,), 32, 8),
    (2, 1, 2, 2, 64, torch.float32, (9, 30), (4, 0), 32, 8),
    (3, 1, 1, 4, 128, torch.float32, (16,), (11,), 16, 12),
    (2, 1, 1, 2, 16, torch.float32, (5,), (100,), 16, 4096),  # a short suffix in a long cache
]


def attention_inputs(N, T, Hkv, G, D, dtype, prefix_lens, suffix_lens, P, S, layers=2):
    """Random q and per-layer cache views (layer 1 of `layers`, as the model passes them), with NaN
    beyond every length so a kernel that reads past one fails."""
    R = len(prefix_lens)
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(DEVICE, dtype)  # noqa: E731
    prefix = [rand(layers, R, Hkv, P, D) for _ in range(2)]
    suffix = [rand(layers, R, N, Hkv, S, D) for _ in range(2)]
    for r, (p, s) in enumerate(zip(prefix_lens, suffix_lens)):
        for c in prefix:
            c[:, r, :, p:] = float("nan")
        for c in suffix:
            c[:, r, :, :, s + T:] = float("nan")
    lens = [torch.tensor(x, dtype=torch.int32, device=DEVICE) for x in (prefix_lens, suffix_lens)]
    return rand(R, N, T, Hkv * G, D), prefix[0][1], prefix[1][1], suffix[0][1], suffix[1][1], *lens


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[0]}-T{c[1]}-G{c[3]}-D{c[4]}-{str(c[5])[6:]}")
def test_particle_attention_matches_reference(case):
    q, pk, pv, sk, sv, plen, slen = attention_inputs(*case)
    scale = q.shape[-1] ** -0.5
    out = kernels.particle_attention(q, pk, pv, sk, sv, plen, slen, scale)
    up = [x.float() for x in (q, pk, pv, sk, sv)]
    ref = kernels.particle_attention_ref(*up, plen, slen, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    tol = 1e-4 if q.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@needs_triton
def test_attention_splits_share_the_live_keys_not_the_capacity():
    """The grid's splits are fixed by the capacity (CUDA graphs), but the kernel divides the live keys
    among them: a short suffix in a long cache spreads over several splits, and the splits past it
    load nothing and stay empty (lse = -inf, output 0)."""
    N, T, G, D, S, live = 2, 1, 2, 16, 4096, 100
    q, _, _, sk, sv, _, slen = attention_inputs(N, T, 1, G, D, torch.float32, (1,), (live,), 16, S)
    plan = kernels.attention_launch(T * G, S, D, q.dtype, kernels.launch_target(q))
    splits, block_n = plan[0], plan[1]["BLOCK_N"]
    lse = q.new_empty(1, N, T, G, splits)
    out = q.new_empty(*lse.shape, D)
    kernels._attend_splits(q, sk, sv, slen, out, lse, 0, plan, D ** -0.5, True)
    used = -(-(live + T) // block_n)  # one tile per split: T * G rows ask for no more
    assert 1 < used < splits
    assert lse[..., :used].isfinite().all() and (lse[..., used:] == float("-inf")).all()
    assert (out[..., used:, :] == 0).all()


@needs_triton
def test_merge_of_splits_with_empty_ones_matches_reference():
    """Splits with no live keys (lse = -inf, output 0) take no share of the merge and bring no NaN in:
    request 0 has an empty prompt (the draft of a one-token prompt) and a short suffix in a long cache,
    beside request 1, whose keys reach into most splits of both passes."""
    case = (2, 2, 2, 2, 16, torch.float32, (0, 40), (3, 50), 48, 256)
    q, pk, pv, sk, sv, plen, slen = attention_inputs(*case)
    N, T, G = case[0], case[1], case[3]
    smem, D = kernels.launch_target(q), case[4]
    assert kernels.attention_launch(N * T * G, 48, D, q.dtype, smem)[0] > 1
    assert kernels.attention_launch(T * G, 256, D, q.dtype, smem)[0] > 1
    out = kernels.particle_attention(q, pk, pv, sk, sv, plen, slen, 0.25)
    assert out.isfinite().all()
    torch.testing.assert_close(out, kernels.particle_attention_ref(q, pk, pv, sk, sv, plen, slen, 0.25),
                               atol=1e-4, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_kernel_matches_reference_with_empty_splits(dtype):
    g = torch.Generator().manual_seed(0)
    out = torch.randn(2, 3, 20, 16, generator=g)  # [rows, heads, splits, D]
    lse = torch.randn(2, 3, 20, generator=g) * 4
    lse[..., 5:9] = float("-inf")  # empty splits
    out[..., 5:9, :] = 0
    out, lse = out.to(DEVICE), lse.to(DEVICE)
    merged = kernels.merge_splits(out, lse, dtype)
    assert merged.shape == (2, 3, 16) and merged.dtype == dtype
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged, kernels.merge_splits_ref(out, lse, dtype), **tol)


# ---------------------------------------------------------------- the layers' glue
# bf16: a rounding or two apart (the interpreter rounds a float32 to bf16 toward zero, a GPU to nearest)
GLUE_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=2e-2)}


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [48, 1100])  # below one block and across two
def test_rms_norm_kernels_match_reference(dtype, dim):
    """rms_norm and the residual add with it, on rows of a strided view (a step's last position) and on whole rows:
    the sum x + y to a rounding, the norm within rounding."""
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(2, 3, 4, dim, generator=g).to(dtype).to(DEVICE)
    y = torch.randn(2, 3, 4, dim, generator=g).to(dtype).to(DEVICE)
    w = (1 + torch.randn(dim, generator=g) / 4).to(dtype).to(DEVICE)
    rows = x[:, :, -1]  # [2, 3, dim], rows evenly spaced
    torch.testing.assert_close(kernels.rms_norm(rows, w, 1e-6), kernels.rms_norm_ref(rows, w, 1e-6), **GLUE_TOL[dtype])
    s, h = kernels.add_rms_norm(x, y, w, 1e-6)
    s_ref, h_ref = kernels.add_rms_norm_ref(x, y, w, 1e-6)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=2**-7)
    torch.testing.assert_close(h, h_ref, **GLUE_TOL[dtype])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [16, 24])  # a power of two, and a head size that is not
def test_rope_kernel_rotates_the_first_heads_in_place_as_the_reference(dtype, D):
    g = torch.Generator().manual_seed(D)
    y = torch.randn(2, 3, 5 * D, generator=g).to(dtype).to(DEVICE)  # [rows..., 5 heads x D]: rotate 3, keep 2
    angles = torch.randn(2, 3, 1, D // 2, generator=g)
    cos = angles.cos().repeat(1, 1, 1, 2).to(DEVICE)  # [2, 3, 1, D], rope_tables' layout
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(DEVICE)
    want = kernels.rope_ref(y.clone(), cos, sin, 3)
    got = kernels.rope(y, cos, sin, 3)
    assert got.data_ptr() == y.data_ptr()
    torch.testing.assert_close(got, want, **GLUE_TOL[dtype])
    assert torch.equal(got[..., 3 * D:], want[..., 3 * D:])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [16, 24])
def test_qk_norm_rope_kernel_normalises_each_head_before_rotating_it(dtype, D):
    """qwen3's q and k heads, each normalised by its own half of the fused weights, then rotated, in place: the
    reference's values within a rounding (bf16: of the normalised values); v's heads as they were."""
    g = torch.Generator().manual_seed(D)
    y = (3 * torch.randn(2, 3, 7 * D, generator=g)).to(dtype).to(DEVICE)  # [rows..., q 3, k 2, v 2 heads x D]
    angles = torch.randn(2, 3, 1, D // 2, generator=g)
    cos = angles.cos().repeat(1, 1, 1, 2).to(DEVICE)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(DEVICE)
    qk_norm = (1 + torch.randn(2 * D, generator=g) / 4).to(dtype).to(DEVICE)
    rotated = kernels.rope_ref(y.clone(), cos, sin, 5)
    want = kernels.qk_norm_rope_ref(y.clone(), cos, sin, 3, 2, qk_norm, 1e-6)
    got = kernels.qk_norm_rope(y, cos, sin, 3, 2, qk_norm, 1e-6)
    assert got.data_ptr() == y.data_ptr()
    tol = GLUE_TOL[dtype] | ({"atol": 3e-2} if dtype == torch.bfloat16 else {})  # normed values up to ~4: steps of 2^-6
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(got[..., 5 * D:], want[..., 5 * D:])
    assert (want - rotated)[..., :5 * D].abs().max() > 0.5  # normalised, not only rotated


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_kernel_matches_reference(dtype):
    x = (torch.randn(3, 2, 2 * 1100, generator=torch.Generator().manual_seed(0)) * 3).to(dtype).to(DEVICE)
    out = kernels.silu_mul(x)
    assert out.shape == (3, 2, 1100) and out.dtype == dtype
    torch.testing.assert_close(out, kernels.silu_mul_ref(x), **GLUE_TOL[dtype])


@pytest.mark.skipif(kernels.triton is None, reason="no triton")
@pytest.mark.parametrize("smem", [166912, 101376, 232448], ids=["A100", "RTX4090", "H100"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("elem", [2, 4])
def test_attention_blocks_fit_shared_memory(smem, D, elem):
    """Blocks for each GPU's per-program shared memory (the opt-in maximum): the kernel's estimated use,
    an upper bound on what Triton allocates for sm_80 and sm_90 (checked by offline compiles), fits."""
    for rows in (1, 8, 40, 128, 1000):
        block_m, block_n, stages = kernels._attention_blocks(rows, D, elem, smem)
        assert elem * D * (block_m + 2 * block_n * stages) + 4 * block_m * block_n <= smem
        assert 16 <= block_m <= 128 and block_n >= 16 and stages >= 1
    if smem == 232448 and D == 128:  # an H100: bf16 128 rows of 32 keys (a tree's masks 64), fp32 FMA-sized tiles
        assert kernels._attention_blocks(128, D, elem, smem) == ((128, 32, 3) if elem == 2 else (32, 16, 2))
        assert kernels._attention_blocks(128, D, elem, smem, tree=True)[0] == (64 if elem == 2 else 32)


@pytest.mark.skipif(kernels.triton is None, reason="no triton")
@pytest.mark.parametrize("smem", [166912, 101376, 232448, 65536], ids=["A100", "RTX4090", "H100", "MI300"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("int4", [False, True], ids=["int8", "int4"])
def test_quantized_matmul_tiles_fit_shared_memory(smem, dtype, int4):
    """The matmul's tile for every row count fits the program's shared memory by its estimate (stages x an activation
    and two weight-sized tiles: above what Triton allocates, int4 included); float32's stay small (FMA dots); int4's
    take whole bytes of whole groups of 32 inputs."""
    for M in (1, 8, 16, 40, 64, 130, 4000):
        o = kernels.quantized_matmul_launch(M, dtype, smem, int4)
        assert o["num_stages"] * o["BLOCK_K"] * (o["BLOCK_M"] + 2 * o["BLOCK_N"]) * dtype.itemsize <= smem
        assert dtype != torch.float32 or o["BLOCK_M"] * o["BLOCK_N"] <= 2048
        assert not int4 or o["BLOCK_K"] % 64 == 0


def test_reference_matches_sdpa_on_one_particle():
    """The reference's masks: one particle with an empty prefix is plain causal attention."""
    T, H, D = 6, 2, 16
    q, k, v = (torch.randn(T, H, D) for _ in range(3))
    zero = torch.tensor([0], dtype=torch.int32)
    out = kernels.particle_attention_ref(q[None, None], k.new_zeros(1, H, 4, D), v.new_zeros(1, H, 4, D),
                                         k.transpose(0, 1)[None, None], v.transpose(0, 1)[None, None], zero, zero, 0.25)
    torch.testing.assert_close(out[0, 0], kernels.prefill_attention(q, k, v, 0.25))


# tree attention (RACER-style draft trees verified in one pass): each implementation against the reference
ATTENTIONS = [pytest.param(kernels.particle_attention, marks=needs_triton, id="triton"),
              pytest.param(cpu_backend.particle_attention_cpu, id="cpu",
                           marks=pytest.mark.skipif(DEVICE != "cpu", reason="the CPU path takes CPU tensors")),
              pytest.param(kernels.particle_attention_ref, id="ref")]


def random_trees(R, T, seed=0):
    """bool [R, T, T], a random tree per request: node j's parent drawn among 0..j-1 (node 0 the root);
    row j is the ancestor-or-self set of node j."""
    gen = torch.Generator().manual_seed(seed)
    trees = torch.eye(T, dtype=torch.bool).repeat(R, 1, 1)
    for r in range(R):
        for j in range(1, T):
            trees[r, j] |= trees[r, torch.randint(j, (), generator=gen)]
    return trees.to(DEVICE)


TREE_CASES = [  # N, T, Hkv, G, D, dtype, prefix lengths, suffix lengths, P, S
    (2, 9, 2, 2, 32, torch.float32, (5, 20), (3, 0), 24, 16),
    (3, 17, 1, 3, 16, torch.float16, (12, 1), (0, 9), 16, 32),  # 2 suffix splits
    (2, 64, 1, 3, 16, torch.float32, (3, 10), (5, 20), 16, 96),  # the paper's largest tree: 2 row blocks
]


@pytest.mark.parametrize("attention", ATTENTIONS[:2])
@pytest.mark.parametrize("case", TREE_CASES, ids=lambda c: f"N{c[0]}-T{c[1]}-G{c[3]}-{str(c[5])[6:]}")
def test_tree_attention_matches_reference(attention, case):
    """Two requests with their own lengths and trees, GQA, several particles; NaN past every length."""
    q, pk, pv, sk, sv, plen, slen = attention_inputs(*case)
    trees, scale = random_trees(len(plen), case[1]), q.shape[-1] ** -0.5
    assert not torch.equal(trees[0], trees[1]) and (trees != torch.ones_like(trees).tril()).any((1, 2)).all()
    out = attention(q, pk, pv, sk, sv, plen, slen, scale, tree=trees)
    ref = kernels.particle_attention_ref(*(x.float() for x in (q, pk, pv, sk, sv)), plen, slen, scale, tree=trees)
    tol = 1e-4 if q.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_causal_tree_is_causal(attention):
    q, pk, pv, sk, sv, plen, slen = attention_inputs(2, 5, 2, 2, 16, torch.float32, (4, 9), (2, 0), 16, 8)
    causal = torch.ones(2, 5, 5, dtype=torch.bool, device=DEVICE).tril()
    torch.testing.assert_close(attention(q, pk, pv, sk, sv, plen, slen, 0.25, tree=causal),
                               attention(q, pk, pv, sk, sv, plen, slen, 0.25), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_tree_node_sees_no_sibling(attention):
    """Request 0's tree: 1 and 2 children of the root 0, 3 a child of 1; request 1 a chain. Changing the
    K/V of node 2 of one particle changes that node's output only: not its sibling 1, nor 1's child 3."""
    q, pk, pv, sk, sv, plen, slen = attention_inputs(2, 4, 2, 2, 16, torch.float32, (6, 3), (2, 5), 8, 12)
    trees = torch.ones(2, 4, 4, dtype=torch.bool, device=DEVICE).tril()
    trees[0, 2, 1] = trees[0, 3, 2] = False
    before = attention(q, pk, pv, sk, sv, plen, slen, 0.25, tree=trees)
    sk[0, 1, :, 2 + 2] += 1.0  # request 0, particle 1, new token 2
    sv[0, 1, :, 2 + 2] += 1.0
    changed = (attention(q, pk, pv, sk, sv, plen, slen, 0.25, tree=trees) - before).abs().amax((-1, -2)) > 0
    assert changed.nonzero().tolist() == [[0, 1, 2]]  # [R, N, T]: (request 0, particle 1, node 2) only


# ---------------------------------------------------------------- sampling

SAMPLERS = [pytest.param(kernels.sample, marks=needs_triton, id="triton"), pytest.param(kernels.sample_ref, id="ref"),
            pytest.param(CPU.sample, id="compiled")]  # float32 rows on the CPU: the C sampler


@pytest.mark.slow
@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("temperatures", [0.7, (0.7, 1.5)], ids=["float", "per-request"])
def test_sample_frequencies_match_tempered_softmax(sampler, temperatures):
    """A float for all rows, or a tensor [R]: each request's rows follow its own tempered softmax."""
    logits, draws = torch.tensor([1.0, 0.0, -0.5, 0.5], device=DEVICE), 600
    per_request = isinstance(temperatures, tuple)
    rng = kernels.make_rng([3, 4] if per_request else 3, DEVICE)
    t = torch.tensor(temperatures, device=DEVICE) if per_request else temperatures
    tokens, _ = sampler(logits.expand(draws, 4), t, rng)
    for rows, temperature in zip(tokens.view(len(rng), -1), temperatures if per_request else [t]):
        expected = len(rows) * torch.softmax(logits / temperature, -1).cpu()
        observed = torch.bincount(rows.cpu(), minlength=4).double()
        assert ((observed - expected) ** 2 / expected).sum() < chi2_quantile(3)


@pytest.mark.slow
@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_sample_logprobs_are_exact(sampler, temperature):
    gen = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(40, 2500, generator=gen)).to(DEVICE, torch.float16)  # several tiles and chunks
    logits[:, 512:1536] = float("-inf")  # masked-out tiles must not poison the running sums
    logits[:, :3] = logits[:, -3:] = float("-inf")  # nor be drawn at either end of the vocabulary
    tokens, logprobs = sampler(logits, temperature, kernels.make_rng(0, DEVICE))
    exact = torch.log_softmax(logits.double() / temperature, -1).gather(-1, tokens[:, None])[:, 0]
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert (((tokens >= 3) & (tokens < 512)) | ((tokens >= 1536) & (tokens < 2497))).all()
    torch.testing.assert_close(logprobs.double(), exact, atol=1e-4, rtol=1e-4)


def test_sample_ref_draws_only_tokens_of_nonzero_probability():
    logits = torch.full((20000, 6), float("-inf"))
    logits[:, 0], logits[:, 4] = 0.0, -30.0  # token 4 is rare but possible; 5 has probability 0 at the end
    tokens = kernels.sample_ref(logits, 1.0, kernels.make_rng(0, "cpu"))[0]
    assert set(tokens.tolist()) <= {0, 4}


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_greedy_is_argmax_with_logprob_zero(sampler):
    logits = torch.randn(4, 300, device=DEVICE)
    tokens, logprobs = sampler(logits, 0.0, kernels.make_rng(0, DEVICE))
    assert torch.equal(tokens, logits.argmax(-1)) and torch.equal(logprobs, torch.zeros_like(logprobs))


@pytest.mark.slow
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_same_seed_same_tokens_new_counter_new_tokens(sampler):
    logits = torch.zeros(16, 1000, device=DEVICE)
    rng_a, rng_b = kernels.make_rng(7, DEVICE), kernels.make_rng(7, DEVICE)
    first = sampler(logits, 1.0, rng_a)[0]
    assert torch.equal(first, sampler(logits, 1.0, rng_b)[0])
    assert rng_a.tolist() == [[7, 1]]
    assert not torch.equal(first, sampler(logits, 1.0, rng_a)[0])
    assert not torch.equal(first, sampler(logits, 1.0, kernels.make_rng(8, DEVICE))[0])


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_sample_batching_never_changes_a_requests_draws(sampler):
    """Request r's noise is keyed on its own (seed, counter) and its rows' index within it: alone or in
    a batch, it draws the same tokens with the same log-probs. Requests 0 and 2 (same seed, temperature
    and logits) are duplicates; request 1 is greedy; every counter advances by 1."""
    M, seeds, temps = 4, [5, 9, 5, 11], [0.7, 0.0, 0.7, 1.3]
    logits = torch.randn(M, 300, generator=torch.Generator().manual_seed(2)).to(DEVICE).repeat(len(seeds), 1)
    temperature, rng = torch.tensor(temps, device=DEVICE), kernels.make_rng(seeds, DEVICE)
    tokens, logprobs = (x.view(len(seeds), M) for x in sampler(logits, temperature, rng))
    assert rng.tolist() == [[s, 1] for s in seeds]
    for r, seed in enumerate(seeds):
        alone = sampler(logits[r * M:(r + 1) * M], temperature[r:r + 1], kernels.make_rng(seed, DEVICE))
        assert torch.equal(alone[0], tokens[r]) and torch.equal(alone[1], logprobs[r])
    assert torch.equal(tokens[0], tokens[2]) and torch.equal(logprobs[0], logprobs[2])
    assert torch.equal(tokens[1], logits[:M].argmax(-1)) and torch.equal(logprobs[1], torch.zeros(M, device=DEVICE))
    assert len(set(tokens[0].tolist())) > 1  # a request's rows draw different noise


LOGPROBS = [pytest.param(kernels.token_logprobs, marks=needs_triton, id="triton"),
            pytest.param(kernels.token_logprobs_ref, id="ref"), pytest.param(CPU.token_logprobs, id="compiled")]


@pytest.mark.parametrize("logprobs", LOGPROBS)
def test_token_logprobs_per_request_temperature(logprobs):
    """A temperature tensor [R] gives request r's rows what the float call on them alone gives."""
    logits, temps = torch.randn(6, 300, device=DEVICE), [0.5, 0.0, 1.3]
    tokens = logits.argmax(-1)
    tokens[1::2] = (tokens[1::2] + 1) % 300  # each request: its argmax token, then another
    out = logprobs(logits, tokens, torch.tensor(temps, device=DEVICE))
    for r, t in enumerate(temps):
        assert torch.equal(out[2 * r:2 * r + 2], logprobs(logits[2 * r:2 * r + 2], tokens[2 * r:2 * r + 2], t))
    assert out[2:4].tolist() == [0.0, float("-inf")] and out[[0, 1, 4, 5]].isfinite().all()


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0])
def test_token_logprobs_matches_reference(temperature):
    logits = torch.randn(64, 1500, device=DEVICE, dtype=torch.bfloat16)
    tokens = torch.cat([logits[:32].float().argmax(-1), torch.randint(0, 1500, (32,), device=DEVICE)])
    out = kernels.token_logprobs(logits, tokens, temperature)
    torch.testing.assert_close(out, kernels.token_logprobs_ref(logits, tokens, temperature), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- resampling

RESAMPLERS = [pytest.param(kernels.resample, marks=needs_triton, id="triton"),
              pytest.param(kernels.resample_ref, id="ref")]


def weights(logw):
    """The weights resample uses: NaN as -inf, an all -inf row as uniform."""
    x = logw.masked_fill(logw.isnan(), float("-inf"))
    empty = (x == float("-inf")).all(-1, keepdim=True)
    return x.masked_fill(empty, 0.0).softmax(-1)


def check_offspring(logw, ancestors):
    """Each particle's offspring count is floor or ceil of N w (up to rounding), zero weights have
    none, and every particle with offspring is its own ancestor (gather never overwrites a source)."""
    R, N = logw.shape
    w = weights(logw.double().cpu())
    ancestors = ancestors.cpu()
    counts = torch.nn.functional.one_hot(ancestors, N).sum(1).double()  # [R, N]
    assert ((counts >= (N * w - 1e-4).floor()) & (counts <= (N * w + 1e-4).ceil())).all()
    assert (counts[w == 0] == 0).all()
    assert torch.equal(ancestors.gather(1, ancestors), ancestors)


@pytest.mark.parametrize("resampler", RESAMPLERS)
def test_resample_offspring_are_floor_or_ceil(resampler):
    gen = torch.Generator().manual_seed(0)
    logw = (2 * torch.randn(3, 8, generator=gen)).to(DEVICE)
    rng = kernels.make_rng([0, 1, 2], DEVICE)
    for _ in range(5):
        ancestors, _, resampled, _ = resampler(logw, 1.0, rng)
        assert resampled.all()
        check_offspring(logw, ancestors)
    assert rng.tolist() == [[0, 5], [1, 5], [2, 5]]


@pytest.mark.parametrize("resampler", RESAMPLERS)
def test_resample_batching_never_changes_a_requests_draws(resampler):
    """Request r's uniform is keyed on its own (seed, counter) only: resampled alone or in a batch, a
    row gets the same ancestors (rows 1 and 3, same weights and seed, are duplicates)."""
    logw = (2 * torch.randn(4, 8, generator=torch.Generator().manual_seed(1))).to(DEVICE)
    logw[3] = logw[1]
    seeds = [3, 1, 4, 1]
    rng = kernels.make_rng(seeds, DEVICE)
    batched = resampler(logw, 1.0, rng)
    assert rng.tolist() == [[s, 1] for s in seeds] and batched[2].all()
    for r, seed in enumerate(seeds):
        alone = resampler(logw[r:r + 1], 1.0, kernels.make_rng(seed, DEVICE))
        assert all(torch.equal(a[0], b[r]) for a, b in zip(alone, batched))
    assert torch.equal(batched[0][1], batched[0][3])


@pytest.mark.parametrize("resampler", RESAMPLERS)
def test_resample_ess_and_thresholds(resampler):
    logw = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, -1.0, -2.0, -30.0], [5.0, -30.0, -30.0, -30.0]], device=DEVICE)
    w = weights(logw)
    rng = kernels.make_rng([0, 1, 2], DEVICE)
    identity = torch.arange(4, device=DEVICE).expand(3, 4)
    ancestors, ess, resampled, degenerate = resampler(logw, 0.0, rng)
    torch.testing.assert_close(ess, 1 / (w * w).sum(-1))
    assert not resampled.any() and not degenerate.any() and torch.equal(ancestors, identity)
    ancestors, _, resampled, _ = resampler(logw, 1.0, rng)
    assert resampled.tolist() == [False, True, True]  # uniform: ESS = N is not below it
    assert torch.equal(ancestors[0], identity[0])
    assert torch.equal(ancestors[2], torch.zeros(4, dtype=torch.int64, device=DEVICE))
    assert resampler(logw, 0.5, rng)[2].tolist() == [False, True, True]  # ESS 4, 1.96, 1


ESS_TOL = 4e-6  # relative: compiled exp and division are approximate (a GPU's ESS is off by ~1e-6 at most)


def assert_flags_agree(ess, resampled, ref_ess, ref_resampled, threshold, N):
    """The kernel's ESS is the reference's up to ESS_TOL, and its flags are the reference's except where
    the ESS lies so close to the limit that the two may fall either side. Equal weights (ESS = N, a
    relative kernels.ESS_RTOL above the limit at threshold 1) lie outside that band: they must agree."""
    torch.testing.assert_close(ess, ref_ess, rtol=ESS_TOL, atol=0)
    limit = kernels._ess_limit(threshold, N)
    near = (ref_ess - limit).abs() <= 2 * ESS_TOL * limit
    assert torch.equal(resampled[~near], ref_resampled[~near])
    assert torch.equal(resampled, ess < limit)  # the kernel's flags are its own ESS's, always


@pytest.mark.parametrize("resampler", RESAMPLERS)
@pytest.mark.parametrize("N, k", [(4, 2), (12, 6)])
def test_resample_only_strictly_below_the_threshold(resampler, N, k):
    """k equal weights among N (the rest -inf) have ESS = k, 1/6 or not, to an ulp or so: threshold k / N
    (here 1/2, ESS = threshold * N) keeps the particles, as the paper's ESS < threshold * N does; a
    threshold beyond the rounding tolerance resamples, each weighted particle taking two slots."""
    logw = torch.full((1, N), float("-inf"), device=DEVICE)
    logw[0, :k] = 0.3
    rng = kernels.make_rng(0, DEVICE)
    ancestors, ess, resampled, degenerate = resampler(logw, k / N, rng)
    assert ess.item() == pytest.approx(k, rel=ESS_TOL)
    assert resampled.tolist() == [False] and degenerate.tolist() == [False]
    assert ancestors.tolist() == [list(range(N))]
    ancestors, ess, resampled, _ = resampler(logw, k / N * (1 + 10 * kernels.ESS_RTOL), rng)
    assert ess.item() == pytest.approx(k, rel=ESS_TOL) and resampled.tolist() == [True]
    assert ancestors.tolist() == [[i % k for i in range(N)]]


@pytest.mark.parametrize("resampler", RESAMPLERS)
@pytest.mark.parametrize("N", [2, 3, 5, 7, 12, 13, 16, 31, 64])
def test_equal_weights_never_resample_at_threshold_one(resampler, N):
    """Threshold 1 resamples whenever the weights are not all equal, but never for equal ones, even where
    their ESS comes out a few ulps below N: log-weights 3000 and four ulps (of 2.4e-4) above give one here,
    as a GPU's approximate exp and division may for exact ties."""
    rng = kernels.make_rng([0, 1], DEVICE)
    below = torch.nextafter(torch.tensor(float(N)), torch.tensor(0.0))  # ESS one ulp below N
    assert not below < kernels._ess_limit(1.0, N)
    logw = torch.full((2, N), 3000.0, device=DEVICE)
    for _ in range(4):  # row 1: every other particle four ulps above 3000
        logw[1, 1::2] = torch.nextafter(logw[1, 1::2], torch.tensor(4e3, device=DEVICE))
    ancestors, ess, resampled, _ = resampler(logw, 1.0, rng)
    assert ess[0] == N and N * (1 - ESS_TOL) < ess[1] < N
    assert resampled.tolist() == [False, False]
    assert torch.equal(ancestors, torch.arange(N, device=DEVICE).expand(2, N))
    logw[1, 0] -= 0.05  # one weight 5% below the others: not equal in any sense
    assert resampler(logw, 1.0, rng)[2].tolist() == [False, True]


@pytest.mark.parametrize("resampler", RESAMPLERS)
def test_resample_exact_offspring(resampler):
    """N w integral: systematic resampling is deterministic, and childless slots fill in order."""
    inf, nan = float("inf"), float("nan")
    logw = torch.tensor([[0.0, -inf, 0.0, -inf], [-inf, -inf, 1.0, -inf], [-1.0, -1.0, nan, nan]], device=DEVICE)
    ancestors, _, _, degenerate = resampler(logw, 1.0, kernels.make_rng([0, 1, 2], DEVICE))
    assert ancestors.tolist() == [[0, 0, 2, 2], [2, 2, 2, 2], [0, 1, 0, 1]]
    assert degenerate.tolist() == [False, False, True]


logw_rows = st.integers(1, 12).flatmap(lambda n: st.lists(st.lists(
    st.one_of(st.floats(-20, 20), st.just(float("-inf")), st.just(float("nan"))), min_size=n, max_size=n),
    min_size=1, max_size=3))


@pytest.mark.slow
@needs_triton
@settings(max_examples=150, deadline=None)
@given(rows=logw_rows, threshold=st.sampled_from([0.0, 0.5, 1.0]), seed=st.integers(0, 2**31))
def test_resample_properties(rows, threshold, seed):
    logw = torch.tensor(rows, dtype=torch.float32, device=DEVICE)
    N = logw.shape[1]
    seeds = [seed + r for r in range(len(rows))]
    out = kernels.resample(logw, threshold, kernels.make_rng(seeds, DEVICE))
    ref = kernels.resample_ref(logw, threshold, kernels.make_rng(seeds, DEVICE))
    ancestors, ess, resampled, degenerate = out
    assert_flags_agree(ess, resampled, ref[1], ref[2], threshold, N)
    assert torch.equal(degenerate, ref[3])
    zero_weight = logw.isnan() | (logw == float("-inf"))
    assert torch.equal(degenerate, logw.isnan().any(-1) | zero_weight.all(-1))
    assert ((ess >= 1) & (ess <= N)).all()
    identity = torch.arange(N, device=DEVICE).expand_as(ancestors)
    assert torch.equal(ancestors[~resampled], identity[~resampled])
    for a in (ancestors, ref[0]):
        check_offspring(logw[resampled], a[resampled])


# ---------------------------------------------------------------- gather

ADVERSARIAL = [
    [1, 2, 2, 0],  # 0 reads 1 while 1 reads 2 and 3 reads 0: chains
    [1, 0, 3, 2],  # swaps
    [1, 2, 3, 0],  # a cycle
    [0, 1, 2, 3],  # identity: nothing moves
    [3, 3, 3, 3],
]


def expected_gather(cache, ancestors, length):
    """The index_select definition, on a copy: rows below length come from the ancestor."""
    out = cache.clone()
    for r in range(cache.shape[1]):
        n = int(length[r])
        out[:, r, :, :, :n] = cache[:, r].index_select(1, ancestors[r])[:, :, :, :n]  # [L, N, H, n, D]
    return out


@pytest.mark.parametrize("gather", [pytest.param(kernels.gather_suffix, marks=needs_triton, id="triton"),
                                    pytest.param(kernels.gather_suffix_ref, id="ref")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_suffix_equals_index_select(gather, dtype):
    L, H, S, D = 2, 2, 9, 64
    ancestors = torch.tensor(ADVERSARIAL, device=DEVICE)
    length = torch.tensor([9, 4, 0, 7, 1], dtype=torch.int32, device=DEVICE)
    cache = torch.randn(L, len(ADVERSARIAL), 4, H, S, D, device=DEVICE).to(dtype)
    expected = expected_gather(cache, ancestors, length)
    assert gather(cache, ancestors, length) is cache
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("gather", [pytest.param(kernels.gather_suffix, marks=needs_triton, id="triton"),
                                    pytest.param(kernels.gather_suffix_ref, id="ref")])
def test_gather_token_history(gather):
    ancestors = torch.tensor(ADVERSARIAL, device=DEVICE)
    length = torch.tensor([5, 3, 6, 2, 0], dtype=torch.int32, device=DEVICE)
    tokens = torch.arange(5 * 4 * 6, device=DEVICE).view(5, 4, 6)
    expected = expected_gather(tokens[None, :, :, None, :, None], ancestors, length)[0, :, :, 0, :, 0]
    gather(tokens, ancestors, length)
    assert torch.equal(tokens, expected)


@pytest.mark.skipif(not kernels.INTERPRET, reason="counts the interpreter's memory operations")
def test_gather_work_follows_the_length_and_the_moves(monkeypatch):
    """No load or store touches a request where no particle moved or whose length is 0, and a short
    length in a long cache takes one row block per (layer, head), not one per block of capacity."""
    from triton.runtime.interpreter import InterpreterBuilder
    L, R, N, H, S, D = 2, 3, 4, 2, 256, 64
    cache = torch.randn(L, R, N, H, S, D)
    ancestors = torch.tensor([[0, 1, 2, 3], [1, 1, 2, 3], [2, 2, 2, 3]])  # request 0 moves nothing
    length = torch.tensor([200, 3, 0], dtype=torch.int32)
    expected = expected_gather(cache, ancestors, length)
    requests = []  # the requests each memory operation on the cache touches
    for name in ("create_masked_load", "create_masked_store"):
        def spy(self, ptrs, *args, op=getattr(InterpreterBuilder, name)):
            at = ptrs.data.astype("int64") - cache.data_ptr()  # byte offsets
            at = at[(at >= 0) & (at < cache.nbytes)]
            if at.size:
                requests.append(set((at // (cache.stride(1) * cache.element_size()) % R).tolist()))
            return op(self, ptrs, *args)
        monkeypatch.setattr(InterpreterBuilder, name, spy)
    kernels.gather_suffix(cache, ancestors, length)
    monkeypatch.undo()
    assert requests == [{1}] * (2 * L * H)  # a load and a store per (layer, head) of request 1
    assert torch.equal(cache, expected)


@needs_triton
def test_resample_then_gather_moves_only_childless_particles():
    logw = torch.tensor([[1.0, 0.0, -9.0, 0.0, -9.0, 0.0]], device=DEVICE)  # N w = 2.85, 1.05, 0, ...
    ancestors, *_ = kernels.resample(logw, 1.0, kernels.make_rng(0, DEVICE))
    history = torch.arange(6, device=DEVICE).view(1, 6, 1).repeat(1, 1, 3)  # each row holds its own index
    kernels.gather_suffix(history, ancestors, torch.tensor([3], dtype=torch.int32, device=DEVICE))
    assert torch.equal(history[0, :, 0], ancestors[0])
    assert torch.equal(ancestors[0, [0, 1, 3, 5]].cpu(), torch.tensor([0, 1, 3, 5]))


# ---------------------------------------------------------------- int8 / int4 matmuls

QUANTIZERS = {"int8": (kernels.quantize_int8, kernels.int8_linear_ref),
              "int4": (kernels.quantize_int4, kernels.int4_linear_ref)}


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantization_error_is_at_most_half_a_step(fmt):
    """Every weight lands on the nearest point of its grid: within half a step (int8: its row's max|w| / 127;
    int4: its group's (max - min) / 15), the rounded scales included; an all-zero row quantizes to zeros."""
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(0)).bfloat16()
    w[5] = 0
    quantize, ref = QUANTIZERS[fmt]
    q, scale = quantize(w)
    dequantized = ref(torch.eye(128), q, scale).T  # the reference's own weights: x = I gives w.T
    step = scale.float()[:, None] if fmt == "int8" else scale[..., 0].float().T.repeat_interleave(32, 1)
    assert ((dequantized - w.float()).abs() <= step / 2 * (1 + 1e-6)).all() and not dequantized[5].any()


@pytest.mark.parametrize("rows", [1, 3, 9, 17, 100])  # decoding's and verifying's few rows, a prefill's many
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_matmul_equals_its_reference(fmt, rows):
    """torch's CPU kernel on the packed weight = dequantize-then-F.linear, up to the bf16 output's rounding."""
    g = torch.Generator().manual_seed(rows)
    w, x = (torch.randn(*s, generator=g).bfloat16() for s in ((48, 128), (2, rows, 128)))
    quantize, ref = QUANTIZERS[fmt]
    q, scale = quantize(w)
    packed = q if fmt == "int8" else torch._convert_weight_to_int4pack_for_cpu(q, 1)
    out = kernels.quantized_linear(x, packed, scale)
    assert out.shape == (2, rows, 48) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref(x, q, scale), atol=0.05, rtol=1e-2)



def test_fp8_weights_are_within_a_rounding_and_the_matmul_is_its_reference():
    """quantize_fp8: every weight within half an e4m3 step of its row's scale (3 mantissa bits: 2**-4 relative),
    an all-zero row zeros; fp8_matmul (torch._scaled_mm) = its float32 reference, x's rows cast on their own scale."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g).bfloat16()
    w[5] = 0
    q, scale = kernels.quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and not q[5].float().any()
    dequantized = q.float() * scale[:, None]
    assert ((dequantized - w.float()).abs() <= w.float().abs() * 2**-4 + scale[:, None] * 2**-9).all()
    x = torch.randn(2, 7, 64, generator=g).bfloat16()
    out = kernels.quantized_linear(x, q, scale)
    assert out.shape == (2, 7, 48) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, kernels.fp8_linear_ref(x.view(14, 64), q, scale).view(2, 7, 48), atol=0.02,
                               rtol=1e-2)


def test_quantizers_leave_a_float32_weight_unchanged():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    for quantize in [q for q, _ in QUANTIZERS.values()] + [kernels.quantize_fp8]:
        before = w.clone()
        quantize(w)
        assert torch.equal(w, before)


def test_pack_int4_round_trip():
    q = torch.randint(0, 16, (6, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = kernels.pack_int4(q)
    assert packed.shape == (6, 32) and packed.dtype == torch.uint8
    assert torch.equal(torch.stack([packed & 15, packed >> 4], -1).flatten(1).int(), q)  # low nibble: even column


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(48, 96), (80, 544)])  # (out, in): in not a multiple of any in-tile, 512 to 64
@pytest.mark.parametrize("rows", [1, 3, 16, 40, 130])  # every tile class: decoding's, verifying's, a prefill's
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_triton_quantized_matmul_equals_its_reference(fmt, rows, shape, dtype):
    """The Triton kernel on its layout (int4 packed by pack_int4) = dequantize-then-F.linear, up to summation order
    and the output's rounding (and on a GPU int4's weights rounded to bf16). On CUDA through quantized_linear, whose
    CPU path takes torch's layout instead."""
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(*shape, generator=g).to(dtype), torch.randn(rows, shape[1], generator=g).to(dtype)
    quantize, ref = QUANTIZERS[fmt]
    q, scale = quantize(w)
    packed = q if fmt == "int8" else kernels.pack_int4(q)
    linear = kernels.quantized_linear if DEVICE == "cuda" else kernels.quantized_matmul
    out = linear(x.to(DEVICE), packed.to(DEVICE), scale.to(DEVICE)).cpu()
    assert out.shape == (rows, shape[0]) and out.dtype == dtype
    tol = dict(atol=0.1, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, ref(x, q, scale), **tol)


# ---------------------------------------------------------------- CUDA graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_draw_fresh_noise_and_read_lengths_on_device():
    q, pk, pv, sk, sv, plen, slen = attention_inputs(*CASES[3])
    logits, rng = torch.zeros(4, 1000, device=DEVICE), kernels.make_rng(0, DEVICE)
    run = lambda: (kernels.particle_attention(q, pk, pv, sk, sv, plen, slen, 0.125),  # noqa: E731
                   kernels.sample(logits, 1.0, rng)[0])
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, tokens = run()
    graph.replay()
    first = tokens.clone()
    slen -= 60
    graph.replay()
    assert not torch.equal(first, tokens) and rng.tolist() == [[0, 3]]
    ref = kernels.particle_attention_ref(q, pk, pv, sk, sv, plen, slen, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
