"""weights/make_gguf.py: GGUF files of real shapes with random weights (bench.py make-gguf), made tiny here: their
blocks, tensor types and tokenizer against the gguf package's own reader, loaded in the engine; bench.py's tables on
them say that the weights are random."""
import pytest
import torch

import bench
import engine
import errors
import kernels
import loading
from benches import common
from cpu import native
from test_model import smollm_gguf, write_gguf
from weights import make_gguf

SMOLLM_VOCAB = 49152
# the layers whose attn_v and ffn_down the real Qwen2.5-Coder-1.5B-Instruct Q4_K_M file (28 layers) holds in Q6_K
REAL_SIX_BIT_LAYERS = {0, 1, 5, 6, 7, 8, 9, 10, 13, 16, 19, 21, 24, 27}


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRET", False)


def tiny(tied=False, vocab=64, layers=4):
    """A tiny qwen2 shape, 4 layers: two of them with attn_v and ffn_down in Q6_K."""
    return make_gguf.Shape(vocab, 256, layers, 4, 2, 512, tied, context=256)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """An untied and a tied tiny file with a 4-token tokenizer, padded to 64 ids."""
    folder = tmp_path_factory.mktemp("made")
    words = str(write_gguf(folder / "words.gguf", "llama", True))
    return {tied: make_gguf.write(str(folder / f"tiny-{tied}.gguf"), "tiny", tiny(tied), words, seed=1,
                                  progress=False) for tied in (False, True)}


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_blocks_hold_the_values_they_quantize(kind):
    """Each block kind, read back by the gguf package, is its normal values within half a step (Q4_K: a group's
    range over 15 steps; Q6_K: its largest magnitude over 31; each a little wider for its rounded scales), with
    finite scales and the spread of a trained model's weights; the engine's dequantization reads the same values."""
    import gguf
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(0)) * make_gguf.STD
    raw = make_gguf.BLOCKS[kind](x).numpy()
    t = gguf.GGMLQuantizationType[kind]
    back = torch.from_numpy(gguf.quants.dequantize(raw, t))
    if kind == "Q4_K":
        groups = x.unflatten(1, (-1, 32))
        step = (groups.amax(-1) - groups.amin(-1).clamp(max=0)) / 15  # [8, groups]
    else:
        groups = x.unflatten(1, (-1, 16))
        step = groups.abs().amax(-1) / 31
    error = (back - x).abs().unflatten(1, groups.shape[1:]).amax(-1)
    assert back.isfinite().all() and (error <= step / 2 + 2e-4).all()
    assert back.std().item() == pytest.approx(make_gguf.STD, rel=0.05)
    assert torch.equal(loading.dequantized(raw, t), back)


def test_q4_k_m_keeps_the_real_files_layers_in_6_bits():
    """llama.cpp counts layers in the file's name order: the real 28-layer Q4_K_M file's attn_v and ffn_down
    layers in Q6_K are these; about half of any depth's."""
    assert make_gguf.six_bit_layers(28) == REAL_SIX_BIT_LAYERS
    assert 16 <= len(make_gguf.six_bit_layers(36)) <= 20


@pytest.mark.parametrize("tied", [False, True])
def test_a_made_file_is_what_ggufs_reader_reads(made, tied):
    """Every tensor of a made file, as the gguf package reads and dequantizes it, is what the engine's loader gets
    (by its Hugging Face name), in Q4_K_M's types (the head and a tied embedding in Q6_K); its metadata marks it
    random, and its tokenizer is its source's, padded past it with unused ids."""
    import gguf
    reader = gguf.GGUFReader(made[tied])
    c, get, tok = loading.open_weights(made[tied])
    s = tiny(tied)
    assert (c.vocab_size, c.dim, c.n_layers, c.ffn_dim, c.tie_embeddings) == (s.vocab, s.dim, s.layers, s.ffn, tied)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types == {name: kind for name, _, kind in make_gguf.tensors(s)}
    six = make_gguf.six_bit_layers(s.layers)
    assert {int(n.split(".")[1]) for n, k in types.items() if n.endswith("attn_v.weight") and k == "Q6_K"} == six
    assert types["token_embd.weight"] == ("Q6_K" if tied else "Q4_K")
    for t in reader.tensors:
        want = torch.tensor(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(tuple(reversed(t.shape)))
        assert want.isfinite().all() and torch.equal(get(loading.hf_name(t.name)), want), t.name
    meta, _ = loading.read_gguf_header(made[tied])
    assert meta[make_gguf.RANDOM_KEY] is True and meta["general.file_type"] == make_gguf.Q4_K_M_FILE_TYPE
    assert tok.encode("abc") == [2, 3]
    assert meta["tokenizer.ggml.tokens"][3:6] == ["c", "[PAD4]", "[PAD5]"] and len(meta["tokenizer.ggml.tokens"]) == 64
    assert meta["tokenizer.ggml.token_type"][3:6] == [3, 5, 5] and len(meta["tokenizer.ggml.token_type"]) == 64


def test_a_real_tokenizer_is_copied_whole(tmp_path):
    """A file made with SmolLM2's tokenizer encodes as SmolLM2 does, its ids past SmolLM2's padded."""
    path = make_gguf.write(str(tmp_path / "m.gguf"), "tiny", tiny(vocab=SMOLLM_VOCAB + 64, layers=1), smollm_gguf(),
                           progress=False)
    meta, _ = loading.read_gguf_header(path)
    tok = loading.open_weights(path).tokenizer
    assert tok.encode("Hello world!") == loading.open_weights(smollm_gguf()).tokenizer.encode("Hello world!")
    assert meta["tokenizer.ggml.tokens"][SMOLLM_VOCAB:SMOLLM_VOCAB + 2] == ["[PAD49152]", "[PAD49153]"]
    assert meta["tokenizer.chat_template"] == loading.read_gguf_header(smollm_gguf())[0]["tokenizer.chat_template"]


@pytest.mark.skipif(native.library()[0] is None, reason="no C compiler: w4a8 falls back to int4")
def test_the_engine_runs_a_made_file_in_w4a8(made):
    """The engine loads a made file in w4a8: its 4- and 6-bit blocks as they are, its Q4_K embedding's rows the
    file's values (held as its blocks), the same read back from the weight cache; it decodes the same tokens from
    the cache; its text is noise."""
    import gguf
    reader = gguf.GGUFReader(made[False])
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    want = torch.tensor(gguf.quants.dequantize(embd.data, embd.tensor_type))
    tokens = []
    for start in ("converted", "read back"):
        lines = []
        e = engine.Engine(made[False], draft="racer", weights="w4a8", on_line=lines.append).load()
        said = "weights kept in" if start == "converted" else "weights read back"
        assert any(line.startswith(said) for line in lines)
        assert torch.equal(e.target.embed[torch.arange(tiny().vocab)], want), start
        assert e.target.layers[0].w2.bits == (6 if 0 in make_gguf.six_bit_layers(4) else 4)
        tokens.append(e.generate([0, 1, 2], method="ar", max_new_tokens=6, temperature=0).tokens)
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6 and all(0 <= t < tiny().vocab for t in tokens[0])


def test_the_benches_run_random_weights_past_eos(made):
    """A made file's runs go to the length asked, as llama.cpp's do (EOS ignored): the benches' engine on one draws
    on where the file's own EOS would have ended it at once."""
    e = engine.Engine(made[False], weights="float32").load()
    first = e.generate([0, 1, 2], method="ar", max_new_tokens=6, temperature=0).tokens
    e.config.eos_ids = [first[0]]
    e.place(e.device, e.draft_config, e.vocab)
    assert e.generate([0, 1, 2], method="ar", max_new_tokens=6, temperature=0).stats["stop"] == "eos"
    assert common.past_eos(e, [None, made[False]]) is e
    result = e.generate([0, 1, 2], method="ar", max_new_tokens=6, temperature=0)
    assert result.tokens == first and result.stats["stop"] == "length"


def test_bench_makes_files_and_says_their_weights_are_random(made, tmp_path, capsys):
    """bench.py make-gguf takes a shape and a folder (a file there is kept); a report on a random file says so
    above each table, one on real weights does not."""
    args = bench.parse(["make-gguf", "qwen2.5-7b", "--dir", str(tmp_path)])
    assert (args.shape, args.dir, args.tokenizer) == ("qwen2.5-7b", str(tmp_path), None)
    kept = tmp_path / make_gguf.file_name("qwen2.5-7b")
    kept.write_bytes(b"")
    bench.main(["make-gguf", "qwen2.5-7b", "--dir", str(tmp_path)])
    assert capsys.readouterr().out == f"{kept}\n" and kept.read_bytes() == b""
    assert common.random_weights([None, made[False]]) and not common.random_weights([smollm_gguf(), None])
    rows = [{"prompt": "code", "method": "ar", "N": 1, "K": 1, "tokens_per_s": 1.0}]
    from benches import report
    text = report.report_tables({"random_weights": True, "speed": rows, "copy_bandwidth_gbs": 10.0, "peer": rows})
    assert text.count(make_gguf.RANDOM_NOTE) == 2
    assert make_gguf.RANDOM_NOTE not in report.report_tables({"speed": rows, "copy_bandwidth_gbs": 10.0})


def test_a_width_of_part_blocks_is_refused(tmp_path):
    """A width that is not whole Q4_K blocks (Qwen2.5-0.5B's 896) is refused in one line, before any file is made."""
    with pytest.raises(errors.LoadError, match=r"^tiny: dim 896 and ffn 512 must be multiples of 256, the values of "):
        make_gguf.write(str(tmp_path / "m.gguf"), "tiny", tiny()._replace(dim=896), smollm_gguf(), progress=False)
    assert not list(tmp_path.iterdir())


def test_a_7b_file_is_sized_as_q4_k_m():
    """Qwen2.5-7B's file: its real 152,064-row vocabulary, untied, about 4.7 GB of tensors; the 3B's tied."""
    s = make_gguf.SHAPES["qwen2.5-7b"]
    assert (s.vocab, s.dim, s.layers, s.heads, s.kv_heads, s.ffn, s.tied) == (152064, 3584, 28, 28, 4, 18944, False)
    assert 4.6e9 < make_gguf.file_bytes(s) < 4.8e9
    three = make_gguf.SHAPES["qwen2.5-3b"]
    assert (three.layers, three.dim, three.ffn, three.heads, three.kv_heads, three.vocab, three.tied) == (
        36, 2048, 11008, 16, 2, 151936, True)
