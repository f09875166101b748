"""What a model's weights take in each format (formats.model_bytes, cpu/formats.py's on a CPU), priced from a file's
headers before any weight is read, against the bytes the converted model holds; the memory checks that use the price
(scheduler's before loading, --weights auto's before timing); w4a8's packing a few rows at a time."""
import pytest
import torch

import engine
import errors
import formats
import kernels
import loading
import platforms
import scheduler
from cpu import formats as cpu_formats
from cpu import native
from test_model import write_gguf, write_mixed_gguf
from weights import make_gguf

FORMATS = ["bf16", "float32", "int8", "int4", "fp8", "w4a8"]
NEEDS_NATIVE = pytest.mark.skipif(native.library()[0] is None, reason="no C compiler: w4a8 falls back to int4")


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRET", False)


def held_bytes(m):
    """The bytes of a model's tensors, each storage once (a tied head that is the embedding counted once)."""
    sizes = {}
    for t in m.parameters():
        key = id(t) if t.is_mkldnn else t.untyped_storage().data_ptr()
        sizes[key] = t.numel() * t.element_size()
    return sum(sizes.values())


def priced_cases():
    """(format, wider, the file's blocks): each format on Q4_K_M's mix (4-bit blocks, v and down in Q6_K) in the
    fast tier; a v in Q8_0 and a draft's (wider=False) in the slow one."""
    mixes = {"q4-q6": dict(down="Q6_K", v="Q6_K"), "q4-q8": dict()}
    for fmt in FORMATS:
        for wider in (True, False):
            for name, blocks in mixes.items():
                marks = [] if wider and name == "q4-q6" else [pytest.mark.slow]
                yield pytest.param(fmt, wider, blocks, id=f"{fmt}-{'wider' if wider else 'four'}-{name}", marks=marks)


@pytest.mark.parametrize("fmt, wider, blocks", priced_cases())
def test_each_format_is_priced_at_the_bytes_its_model_holds(tmp_path, fmt, wider, blocks):
    """A GGUF model of 4-, 6- and 8-bit blocks and a tied float embedding, built in each format on the CPU (w4a8 too)
    and by formats.py (a GPU's, here on the CPU): the price from its headers is what the model holds, within 0.1%
    (w4a8's outlier channels, one more or less)."""
    if fmt == "w4a8" and native.library()[0] is None:
        pytest.skip("no C compiler: w4a8 falls back to int4")
    c, get, _ = loading.open_weights(write_mixed_gguf(tmp_path / "m.gguf", "qwen2", **blocks))
    kinds = formats.file_kinds(c, get)
    cpu = platforms.Cpu(torch.device("cpu")).convert(c, get, weights=fmt, wider=wider)
    assert cpu_formats.model_bytes(c, fmt, kinds, wider) == pytest.approx(held_bytes(cpu), rel=1e-3)
    if fmt != "w4a8":
        gpu = formats.build(c, get, "cpu", weights=fmt, wider=wider)
        assert formats.model_bytes(c, fmt, kinds, wider) == pytest.approx(held_bytes(gpu), rel=1e-3)


@pytest.mark.parametrize("fmt", ["w4a8", "int4", "bf16"])
def test_a_q4_k_m_file_is_priced_at_what_its_model_holds(tmp_path, fmt):
    """A file of Q4_K_M's types (make_gguf's: Q4_K, Q6_K in v, down and the head, an untied Q4_K embedding, which
    w4a8 holds as its blocks, a third of its float32 bytes): priced at what its model holds; w4a8 near the file."""
    if fmt == "w4a8" and native.library()[0] is None:
        pytest.skip("no C compiler: w4a8 falls back to int4")
    words = str(write_gguf(tmp_path / "words.gguf", "llama", True))
    s = make_gguf.Shape(1024, 256, 4, 4, 2, 512, False, context=64)
    path = make_gguf.write(str(tmp_path / "m.gguf"), "tiny", s, words, progress=False)
    c, get, _ = loading.open_weights(path)
    m = platforms.Cpu(torch.device("cpu")).convert(c, get, weights=fmt)
    price = cpu_formats.model_bytes(c, fmt, formats.file_kinds(c, get))
    assert price == pytest.approx(held_bytes(m), rel=1e-3)
    if fmt == "w4a8":
        assert isinstance(m.embed, cpu_formats.Rows) and price < 1.1 * make_gguf.file_bytes(s)


@NEEDS_NATIVE
@pytest.mark.parametrize("bits", [4, 6, 8])
def test_w4a8_packs_a_few_rows_at_a_time_as_it_packs_them_all(monkeypatch, bits):
    """pack_rows gives native.pack's bytes (w4a8_bytes of them), packing PACK_ROWS rows at a time, a superblock
    short at the end of each row (10 groups of 32: one superblock and 2 groups)."""
    w = torch.randn(80, 320, generator=torch.Generator().manual_seed(0)) * 0.02
    blocks = native.quantize(w, bits)
    whole = native.pack(*blocks, bits)
    monkeypatch.setattr(cpu_formats, "PACK_ROWS", 32)
    assert torch.equal(cpu_formats.pack_rows(*blocks, bits), whole)
    assert whole.numel() == cpu_formats.w4a8_bytes(80, 320, bits)


def test_the_weights_check_prices_each_format(tmp_path, monkeypatch):
    """Free memory between the model's w4a8 and float32 prices: w4a8 loads and decodes; float32 (4 bytes a weight,
    what the check once priced w4a8 at) is refused in one line before any weight is read."""
    path = write_mixed_gguf(tmp_path / "m.gguf", "qwen2")
    c, get, _ = loading.open_weights(path)
    kinds = formats.file_kinds(c, get)
    small = cpu_formats.model_bytes(c, "w4a8", kinds)
    large = cpu_formats.model_bytes(c, "float32", kinds)
    assert large > 4 * small
    monkeypatch.setattr(scheduler, "free_bytes", lambda device: (small + large) // 2)
    with pytest.raises(errors.UsageError, match=r"^the weights need 0.00 GiB but only 0.00 GiB is free on cpu; "):
        engine.Engine(path, weights="float32")
    e = engine.Engine(path, weights="w4a8" if native.library()[0] else "int4")
    assert scheduler.unread_bytes(e) == cpu_formats.model_bytes(c, e.weights, kinds)
    monkeypatch.setattr(scheduler, "free_bytes", lambda device: small + (1 << 20))  # the weights and a batch
    assert len(e.generate([1, 2, 3], method="ar", max_new_tokens=4, temperature=0).tokens) == 4


@NEEDS_NATIVE
def test_auto_times_w4a8_where_it_fits_and_says_why_not_where_not(tmp_path, monkeypatch):
    """--weights auto on a 4-bit file times w4a8 where its price fits and float32's does not; with less free than
    w4a8's price, one line says so and w4a8 is not timed. Before it chooses, the engine's check needs only the
    least any format takes."""
    path = write_mixed_gguf(tmp_path / "m.gguf", "qwen2")
    c, get, _ = loading.open_weights(path)
    kinds = formats.file_kinds(c, get)
    small = cpu_formats.model_bytes(c, "w4a8", kinds)
    monkeypatch.setattr(scheduler, "free_bytes", lambda device: 2 * small)
    lines = []
    e = engine.Engine(path, weights="auto", on_line=lines.append)
    assert scheduler.unread_bytes(e) == min(cpu_formats.model_bytes(c, f, kinds) for f in formats.FORMATS)
    target, _ = e.measurement.candidates()
    assert "w4a8" in target and "float32" not in target and not lines
    e.measurement.free_bytes = small - 1
    target, drafts = e.measurement.candidates()
    assert "w4a8" not in target and "w4a8" in drafts
    assert lines == [f"weights auto: w4a8 not timed: its weights need {small / 2**30:.2f} GiB, "
                     f"{(small - 1) / 2**30:.2f} GiB is free"]
