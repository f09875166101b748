"""cpu.native: the compiled w4a8 matmul against its PyTorch reference, on every instruction set this CPU can run."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import formats
import kernels
import model
from cpu import native, store
from cpu import formats as cpu_formats

needs_kernel = pytest.mark.skipif(native.library()[0] is None, reason="no C compiler: the int4 fallback serves")


def weights(out, n, bits, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, n, generator=g) * 0.05
    w[:, 3] += 0.5  # a large input channel, as real models have
    codes, scale, low = native.quantize(w, bits)
    return w, codes, scale, low


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_quantize_bounds_the_error_by_half_a_step(bits):
    w, codes, scale, low = weights(32, 64, bits)
    assert codes.max() <= 2**bits - 1
    size = w.shape[1] // scale.shape[1]  # inputs a scale: 32, or 16 for 6 bits
    err = (native.dequantize(codes, scale, low) - w).abs().unflatten(1, (-1, size)).amax(-1)  # [out, in / size]
    assert (err <= scale.float() * 0.5 + 1e-3 * w.abs().max()).all()


@pytest.mark.parametrize("per, low, high", [(8, 0, 63), (8, -63, 0), (16, -128, 127)])
def test_split_scales_keeps_a_k_blocks_scales_exactly(per, low, high):
    """A GGUF K block's scales (Q4_K's d x 6-bit sc and dmin x m, Q6_K's d x int8 sc; d an f16, negative in some
    Q6_K blocks, where sc reaches -128) come back exactly; other values within half a step of 1/127 of their
    superblock's largest, rounded as asked (up: never below)."""
    g = torch.Generator().manual_seed(per + low)
    sign = torch.where(torch.rand(40, 3, generator=g) < 0.5, 1, -1)
    d = (torch.rand(40, 3, generator=g) * 2e-3).half().float() * sign  # [40, superblocks]
    d[0] = 2**-24 * 157  # a subnormal float16
    steps = torch.randint(low, high + 1, (40, 3 * per), generator=g).float()
    steps[:, 0] = low
    values = d.repeat_interleave(per, 1) * steps  # [40, 3 x per]
    assert torch.equal(native.as_packed(values, per), values)
    other = torch.rand(40, 3 * per, generator=g) * 0.01
    largest = other.unflatten(1, (3, per)).amax(-1).repeat_interleave(per, 1)
    assert ((native.as_packed(other, per) - other).abs() <= largest / 254 * 1.01).all()
    assert (native.as_packed(other, per, torch.ceil) >= other).all()


def test_quantize_rows_ref_steps_and_sums():
    """A superblock of 8 groups shares one step (its largest |x| / 127), the last one of a row maybe fewer groups."""
    x = torch.zeros(1, 320)  # a superblock of 8 groups, then one of 2
    x[0, 32:35] = torch.tensor([1.0, -2.0, 0.5])
    x[0, 256] = 4.0
    xq, dx, xs = native.quantize_rows_ref(x)
    assert dx.tolist() == [[pytest.approx(2 / 127)] * 8 + [pytest.approx(4 / 127)] * 2]
    assert xq[0, 32:35].tolist() == [64, -127, 32]  # 63.5 and 31.75 rounded half to even
    assert xq[0, 256].item() == 127 and xq[0, :32].abs().sum() == 0
    assert xs[0, 1].item() == pytest.approx(dx[0, 1].item() * (64 - 127 + 32))


@needs_kernel
def test_quantize_rows_matches_the_reference_exactly():
    x = torch.randn(7, 544) * torch.logspace(-3, 2, 544)  # 17 groups: two superblocks and one group
    x[2, :256] = 0  # an all-zero superblock has step 0
    for got, want in zip(native.quantize_rows(x), native.quantize_rows_ref(x)):
        assert torch.equal(got, want)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9, 16, 17, 35])
@pytest.mark.parametrize("n", [160, 544])  # inputs: 5 groups, a superblock short of 8; 17, two superblocks and 1
def test_w4a8_linear_matches_the_reference(bits, rows, n):
    _, codes, scale, low = weights(48, n, bits)
    packed = native.pack(codes, scale, low, bits)
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows))
    want = native.w4a8_linear_ref(x, codes, scale, low)
    torch.testing.assert_close(native.w4a8_linear(x, packed, bits), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("n", [160, 544])
def test_columns_are_the_weights_own_as_dequantize_gives_them(bits, n):
    """Read from the packed bytes, exactly: each group's place in its superblock (the last one short of 8), the input's
    vector and nibble (6 bits: its high bits, its half group's scale)."""
    _, codes, scale, low = weights(48, n, bits)
    at = torch.tensor([0, 3, 17, 37, 100, n - 33, n - 1])
    got = native.columns(native.pack(codes, scale, low, bits), bits, n, at)
    assert torch.equal(got, native.dequantize(codes, scale, low)[:, at].T)


def outliers_of(packed, bits, n, channels):
    at = torch.tensor(channels, dtype=torch.int32)
    return at, native.columns(packed, bits, n, at)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("rows", [1, 9, 17])
def test_outlier_inputs_kept_out_of_the_rounding_are_multiplied_in_float(bits, rows):
    """A channel 100 times the others' size sets its group's step: rounded, the other 31 inputs there lose their
    digits; kept out (its value times the weight's column, in float32), the call is far nearer the exact product."""
    _, codes, scale, low = weights(48, 160, bits)
    packed = native.pack(codes, scale, low, bits)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    x[:, 37] = 100.0
    outliers = outliers_of(packed, bits, 160, [37, 100])
    want = native.w4a8_linear_ref(x, codes, scale, low, outliers)
    got = native.w4a8_linear(x, packed, bits, outliers=outliers)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    exact = x @ native.dequantize(codes, scale, low).T
    rounded = native.w4a8_linear(x, packed, bits)
    assert (got - exact).abs().max() < (rounded - exact).abs().max() / 4
    with pytest.raises(ValueError, match="at most 8 channels"):
        native.w4a8_linear(x, packed, bits, outliers=(outliers[0], outliers[1][:, :16]))


@needs_kernel
@pytest.mark.parametrize("extra", ["normed", "gated", "tail"])
def test_outliers_are_channels_of_the_prepared_input(extra):
    """After the norm or the gate, as the reference takes its input; a tail's columns follow the head's."""
    _, codes, scale, low = weights(32, 160, 4)
    _, codes6, scale6, low6 = weights(16, 160, 6, seed=1)
    packed = native.pack(codes, scale, low, 4)
    packed6 = native.pack(codes6, scale6, low6, 6)
    g = torch.Generator().manual_seed(3)
    x = 3 * torch.randn(9, 320 if extra == "gated" else 160, generator=g)
    x[:, 37] *= 50
    norm = torch.rand(160, generator=g) + 0.5
    at, w_at = outliers_of(packed, 4, 160, [5, 37])
    if extra == "tail":
        w_at = torch.cat([w_at, native.columns(packed6, 6, 160, at)], 1)
    if extra == "gated":
        gate, up = x.chunk(2, -1)
        prepared = F.silu(gate) * up
    else:
        prepared = F.rms_norm(x, (160,), norm, 1e-6)
    want = native.w4a8_linear_ref(prepared, codes, scale, low, (at, w_at[:, :32]))
    if extra == "tail":
        want = torch.cat([want, native.w4a8_linear_ref(prepared, codes6, scale6, low6, (at, w_at[:, 32:]))], -1)
    options = {"normed": dict(norm=norm, eps=1e-6), "gated": dict(gated=True),
               "tail": dict(norm=norm, eps=1e-6, tail=(packed6, 6))}[extra]
    assert nearly(native.w4a8_linear(x, packed, 4, outliers=(at, w_at), **options), want)


@needs_kernel
def test_rows_alike_but_at_an_outlier_each_get_their_own():
    """Equal rows are multiplied once, and rows that differ only at an outlier channel quantize alike: each row's
    own outlier inputs are added after its share of the product, so each still gets the bits it gets alone."""
    _, codes, scale, low = weights(32, 96, 4)
    packed = native.pack(codes, scale, low, 4)
    outliers = outliers_of(packed, 4, 96, [40])
    x = torch.randn(1, 96).repeat(4, 1)
    x[1, 40] += 3.0
    x[3, 40] -= 1.0
    together = native.w4a8_linear(x, packed, 4, outliers=outliers)
    for i in range(4):
        assert torch.equal(native.w4a8_linear(x[i:i + 1], packed, 4, outliers=outliers), together[i:i + 1])
    assert torch.equal(together[0], together[2])
    assert not torch.equal(together[0], together[1])


def nearly(got, want):
    """Equal up to float32's rounding of the prepared rows, which can move an activation code by one step (a few in a
    thousand outputs off by that much)."""
    close = torch.isclose(got, want, rtol=1e-5, atol=1e-5)
    return close.float().mean() > 0.99 and (got - want).abs().max() < 0.01 * want.abs().max()


@needs_kernel
@pytest.mark.parametrize("bits", [4, 6])
@pytest.mark.parametrize("rows", [1, 9])
def test_the_norm_and_bias_in_the_call_are_rms_norm_then_the_reference_plus_bias(bits, rows):
    """The backend's normed_linear in one call, nearly: float32 rounds the normalised rows in another order."""
    _, codes, scale, low = weights(48, 160, bits)
    packed = native.pack(codes, scale, low, bits)
    g = torch.Generator().manual_seed(rows)
    x = 3 * torch.randn(rows, 160, generator=g)
    norm = torch.rand(160, generator=g) + 0.5
    bias = torch.randn(48, generator=g)
    want = native.w4a8_linear_ref(F.rms_norm(x, (160,), norm, 1e-6), codes, scale, low) + bias
    assert nearly(native.w4a8_linear(x, packed, bits, bias, norm, 1e-6), want)
    with pytest.raises(ValueError, match="contiguous float32"):
        native.w4a8_linear(x, packed, bits, bias.double())


def rope_rows(rows, D, seed):
    """cos, sin [rows, D] of rope_tables at random positions: each row its own, as model.step passes them."""
    c = model.Config(arch="llama", vocab_size=8, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=D,
                     ffn_dim=32, rope_theta=10000.0, max_seq_len=512)
    cos, sin = model.rope_tables(c, "cpu")
    at = torch.randint(0, 512, (rows,), generator=torch.Generator().manual_seed(seed))
    return cos[at].contiguous(), sin[at].contiguous()


@needs_kernel
@pytest.mark.parametrize("bits", [4, 6])
@pytest.mark.parametrize("rows", [1, 9])
def test_the_gate_and_the_rotation_in_the_call_are_swiglu_and_apply_rope_around_the_reference(bits, rows):
    """The backend's gated_linear in one call (silu(gate) x up into w2) and normed_linear's RoPE (wqkv's q and k heads,
    after the bias), each against torch's operators around the reference."""
    _, codes, scale, low = weights(48, 160, bits)
    packed = native.pack(codes, scale, low, bits)
    g = torch.Generator().manual_seed(rows)
    x = 3 * torch.randn(rows, 320, generator=g)
    gate, up = x.chunk(2, -1)
    want = native.w4a8_linear_ref(F.silu(gate) * up, codes, scale, low)
    assert nearly(native.w4a8_linear(x, packed, bits, gated=True), want)
    bias = torch.randn(48, generator=g)
    cos, sin = rope_rows(rows, 16, rows)
    want = (native.w4a8_linear_ref(gate, codes, scale, low) + bias).unflatten(-1, (3, 16))
    want[:, :2] = kernels.apply_rope(want[:, :2], cos[:, None], sin[:, None])  # two heads rotated, the third not
    assert nearly(native.w4a8_linear(gate, packed, bits, bias, rope=(cos, sin, 2)), want.flatten(1))
    with pytest.raises(ValueError, match="each of the"):
        native.w4a8_linear(torch.cat([gate, gate]), packed, bits, rope=(cos, sin, 2))
    with pytest.raises(ValueError, match="not both"):
        native.w4a8_linear(x, packed, bits, norm=torch.ones(160), gated=True)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_a_tail_in_other_bits_is_the_rest_of_one_matrix(rows):
    """A fused q/k/v whose v a file holds in 6 bits: 32 rows of 4-bit codes and 16 of 6-bit ones in one call, the
    norm before, the bias and the rotation of the first two heads after, over all 48 outputs."""
    _, codes, scale, low = weights(32, 160, 4)
    _, codes6, scale6, low6 = weights(16, 160, 6, seed=1)
    g = torch.Generator().manual_seed(rows)
    x = 3 * torch.randn(rows, 160, generator=g)
    norm = torch.rand(160, generator=g) + 0.5
    bias = torch.randn(48, generator=g)
    cos, sin = rope_rows(rows, 16, rows)
    normed = F.rms_norm(x, (160,), norm, 1e-6)
    want = torch.cat([native.w4a8_linear_ref(normed, codes, scale, low),
                      native.w4a8_linear_ref(normed, codes6, scale6, low6)], -1) + bias
    want = want.unflatten(-1, (3, 16))
    want[:, :2] = kernels.apply_rope(want[:, :2], cos[:, None], sin[:, None])
    tail = (native.pack(codes6, scale6, low6, 6), 6)
    got = native.w4a8_linear(x, native.pack(codes, scale, low, 4), 4, bias, norm, 1e-6, rope=(cos, sin, 2),
                                  tail=tail)
    assert nearly(got, want.flatten(1))


@needs_kernel
@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("extra", ["plain", "normed", "gated", "rotated"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(bits, extra):
    """The exact methods need it: a row alone and in a batch of any size give the same bits."""
    _, codes, scale, low = weights(32, 96, bits)
    packed = native.pack(codes, scale, low, bits)
    x = torch.randn(20, 192 if extra == "gated" else 96)
    cos, sin = rope_rows(20, 16, 0)
    options = {"plain": {}, "normed": dict(bias=torch.randn(32), norm=torch.rand(96) + 0.5, eps=1e-6),
               "gated": dict(gated=True), "rotated": {}}[extra]

    def call(at):
        rope = (cos[at], sin[at], 1) if extra == "rotated" else None
        return native.w4a8_linear(x[at], packed, bits, rope=rope, **options)
    together = call(slice(0, 20))
    for i in (0, 7, 19):
        assert torch.equal(call(slice(i, i + 1)), together[i:i + 1])
    assert torch.equal(call(slice(0, 5)), together[:5])


@needs_kernel
@pytest.mark.parametrize("bits", [4, 6])
def test_a_long_prompts_rows_in_blocks_get_the_bits_each_row_gets_alone(bits):
    """A prompt's rows go through the panels a cache-sized block at a time (8 MiB of quantized rows: 672 rows of 8,192
    inputs); a row in the second block, or at either side of the seam, gets the same bits as alone."""
    _, codes, scale, low = weights(32, 8192, bits)
    packed = native.pack(codes, scale, low, bits)
    x = torch.randn(700, 8192, generator=torch.Generator().manual_seed(1))
    together = native.w4a8_linear(x, packed, bits)
    for i in (0, 671, 672, 699):
        assert torch.equal(native.w4a8_linear(x[i:i + 1], packed, bits), together[i:i + 1]), i


@needs_kernel
@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("extra", ["plain", "normed", "gated", "rotated", "tail"])
def test_rows_quantized_alike_each_get_the_result_of_their_own(bits, extra):
    """A call multiplies equal rows once (a particle's copies after resampling): every row, first or repeated, gets
    the bits it gets alone, and its own rotation and bias after."""
    _, codes, scale, low = weights(32, 96, bits)
    packed = native.pack(codes, scale, low, bits)
    distinct = torch.randn(4, 192 if extra == "gated" else 96)
    order = torch.tensor([0, 1, 0, 2, 1, 0, 3, 0, 2])  # repeats before and after other rows
    x = distinct[order]
    cos, sin = rope_rows(len(order), 16, 1)
    _, codes6, scale6, low6 = weights(16, 96, 6, seed=1)
    options = {"plain": {}, "normed": dict(bias=torch.randn(32), norm=torch.rand(96) + 0.5, eps=1e-6),
               "gated": dict(gated=True), "rotated": {},
               "tail": dict(bias=torch.randn(48), tail=(native.pack(codes6, scale6, low6, 6), 6))}[extra]

    def call(at):
        rope = (cos[at], sin[at], 1) if extra == "rotated" else None
        return native.w4a8_linear(x[at], packed, bits, rope=rope, **options)
    together = call(slice(0, len(order)))
    for i in range(len(order)):
        assert torch.equal(call(slice(i, i + 1)), together[i:i + 1])
    if extra == "rotated":  # the same input at other positions: other outputs
        assert not torch.equal(together[0], together[2])
    else:
        assert torch.equal(together[0], together[7])


@needs_kernel
@pytest.mark.parametrize("temperature", [0.6, 1.0, 0.0])
def test_the_compiled_sampler_draws_by_the_exact_inverse_cdf(temperature):
    """Each row's token is where its uniform falls in the float64 running sum of softmax(logits / T) (to rounding),
    never a token of probability 0, with its exact log-prob; at T = 0 the first largest logit, log-prob 0."""
    g = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(48, 5000, generator=g)
    logits[:, 700:2100] = float("-inf")  # whole chunks of no probability
    logits[:, :260] = logits[:, -2:] = float("-inf")  # and at either end (a whole chunk first)
    u = torch.rand(48, generator=g)
    u[:2] = torch.tensor([0.0, 1.0])  # the first token of nonzero probability; past every sum (as u x total may
    # round): the last one
    tokens, logprobs = native.sample(logits, torch.full((48,), temperature), u)
    if temperature == 0:
        assert torch.equal(tokens, logits.argmax(-1)) and not logprobs.any()
        return
    exact = torch.log_softmax(logits.double() / temperature, -1)
    cdf = exact.exp().cumsum(-1)
    below = cdf.gather(1, (tokens - 1)[:, None])[:, 0]  # the mass before the token
    assert logits.gather(1, tokens[:, None]).isfinite().all()
    assert ((below <= u + 1e-5) & (cdf.gather(1, tokens[:, None])[:, 0] >= u - 1e-5)).all()
    assert tokens[0] == 260 and tokens[1] == 4997
    torch.testing.assert_close(logprobs.double(), exact.gather(1, tokens[:, None])[:, 0], atol=1e-4, rtol=1e-4)
    picked = torch.randint(0, 5000, (48,), generator=g)
    want = exact.gather(1, picked[:, None])[:, 0].float()
    torch.testing.assert_close(native.token_logprobs(logits, picked, torch.full((48,), temperature)), want,
                               atol=1e-4, rtol=1e-4)


@needs_kernel
def test_a_row_of_no_probability_draws_its_last_token():
    logits = torch.full((2, 600), float("nan"))
    logits[1] = float("-inf")
    tokens, logprobs = native.sample(logits, torch.ones(2), torch.full((2,), 0.5))
    assert tokens.tolist() == [599, 599] and logprobs.isnan().all()


def test_pack_refuses_a_shape_the_kernel_cannot_tile():
    codes = torch.zeros(24, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="16k x 32k"):
        native.pack(codes, torch.ones(24, 2), torch.zeros(24, 2), 4)


def isa_flags():
    """-march choices this CPU can run, each compiling one of native.c's paths (the portable one always)."""
    flags = set(open("/proc/cpuinfo").read().split()) if os.path.exists("/proc/cpuinfo") else set()
    marches = {"portable": ["-march=x86-64"] if "sse2" in flags else ["-O0"]}
    if {"avx2", "fma", "f16c"} <= flags:
        marches["avx2"] = ["-march=haswell"]
    if {"avx512_vnni", "avx512vl"} <= flags:
        marches["avx512_vnni_256"] = ["-march=native", "-mno-avx512bw"]
    return marches


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("isa", sorted(isa_flags()))
def test_every_path_of_the_source_matches_the_reference(isa, tmp_path, monkeypatch):
    monkeypatch.setenv(store.CACHE_ENV, str(tmp_path))
    march = isa_flags()[isa]
    flags = ["-O3", *march, "-fopenmp", "-shared", "-fPIC"]
    if march == ["-O0"]:
        flags = ["-O0", "-fopenmp", "-shared", "-fPIC"]
    lib = native.load(native.build(native.compiler(), flags))
    assert lib.isa().decode() == isa
    monkeypatch.setitem(native._library, "lib", lib)
    for bits in (4, 6, 8):
        _, codes, scale, low = weights(32, 128, bits)
        packed = native.pack(codes, scale, low, bits)
        for rows in (1, 3, 4, 7):
            x = torch.randn(rows, 128)
            want = native.w4a8_linear_ref(x, codes, scale, low)
            torch.testing.assert_close(native.w4a8_linear(x, packed, bits), want, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.slow
def test_the_build_is_kept_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv(store.CACHE_ENV, str(tmp_path))
    first = native.build(native.compiler())
    made = os.stat(first).st_mtime_ns
    assert native.build(native.compiler()) == first
    assert os.stat(first).st_mtime_ns == made
    assert os.listdir(tmp_path) == [os.path.basename(first)]  # no temporary left beside it


def test_no_compiler_is_one_line_and_no_library(tmp_path):
    code = "from cpu import native; lib, why = native.library(); print(lib, why)"
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), store.CACHE_ENV: str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(native.SOURCE)))
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("None ")
    assert len(run.stdout.strip().splitlines()) == 1


def test_without_the_kernel_w4a8_is_int4_with_one_line(monkeypatch, caplog):
    monkeypatch.setitem(native._library, "lib", None)
    monkeypatch.setitem(native._library, "why", "the w4a8 kernel cannot be built here (no C compiler found)")
    assert cpu_formats.usable("w4a8") == "int4"
    assert cpu_formats.usable("int8") == "int8"
    assert [r.getMessage() for r in caplog.records] == [
        "the w4a8 kernel cannot be built here (no C compiler found); using int4 (torch's kernel) instead of w4a8"]


@needs_kernel
@pytest.mark.parametrize("N, T, tree", [(1, 1, False), (3, 3, False), (2, 4, True)])
def test_particle_attention_matches_the_reference_per_request(N, T, tree):
    """Request 0's step is small (the compiled kernel's), request 1's large (given to `large`, here the reference):
    both the reference's, each request on its own; a one-token prompt (no prefix) included."""
    import kernels
    g = torch.Generator().manual_seed(N * 10 + T)
    R = 2  # requests
    Hq = 8
    Hkv = 2
    D = 32
    q = torch.randn(R, N, T, Hq, D, generator=g)
    prefix_k = torch.randn(R, Hkv, 4000, D, generator=g)
    prefix_v = torch.randn(R, Hkv, 4000, D, generator=g)
    suffix_k = torch.randn(R, N, Hkv, 16, D, generator=g)
    suffix_v = torch.randn(R, N, Hkv, 16, D, generator=g)
    suffix_len = torch.tensor([5, 3], dtype=torch.int32)
    sees = None
    if tree:
        sees = (torch.rand(R, T, T, generator=g) > 0.5).tril() | torch.eye(T, dtype=torch.bool)
    calls = []

    def large(*args):
        calls.append(args[0].shape)
        return kernels.particle_attention_ref(*args)
    for prefix_len in (torch.tensor([40, 3999], dtype=torch.int32), torch.tensor([0, 3999], dtype=torch.int32)):
        args = (q, prefix_k, prefix_v, suffix_k, suffix_v, prefix_len, suffix_len, D ** -0.5, sees)
        want = kernels.particle_attention_ref(*args)
        torch.testing.assert_close(native.particle_attention(*args, large=large), want, rtol=1e-5, atol=1e-5)
    assert calls == [(1, N, T, Hq, D)] * 2  # request 1 only


@needs_kernel
def test_the_layer_call_reads_the_clock_only_when_asked(tmp_path, monkeypatch):
    """decoder_layer hands its C code no timing array (NULL: no clock read) unless a native.timing() block is open;
    inside one, its seconds by part (LAYER_PARTS) add up there, and a closed block's array gains no more."""
    import loading
    import platforms
    from test_model import write_mixed_gguf
    c, get, _ = loading.open_weights(write_mixed_gguf(tmp_path / "m.gguf", "qwen2"))
    m = platforms.build(c, get, weights="w4a8")
    cache = model.KVCache(m.config, 1, 8, 8, "cpu", torch.float32)
    m.prefill(torch.tensor([3, 1, 4]), cache)
    lib = native.library()[0]
    layer = lib.decoder_layer
    spent = []
    monkeypatch.setattr(lib, "decoder_layer", lambda *args: spent.append(args[-2]) or layer(*args))
    m.step(torch.tensor([[[5]]]), cache)
    assert spent == [None] * c.n_layers and native.layer_timing() is None
    with native.timing() as seconds:
        assert native.layer_timing() is seconds
        m.step(torch.tensor([[[9]]]), cache)
    assert spent[-1] is seconds and all(s > 0 for s in seconds) and len(seconds) == len(native.LAYER_PARTS)
    timed = list(seconds)
    m.step(torch.tensor([[[2]]]), cache)
    assert list(seconds) == timed and spent[-1] is None
