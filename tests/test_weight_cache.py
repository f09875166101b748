"""weight_cache.py on tiny models: a second load reads the kept tensors back and gives the logits of a fresh build in
every weight format; a changed model file, another key, a damaged file or an unwritable folder each give one line and
a normal, correct load; the kept file is safetensors; the engine reads its pair back."""
import errno
import json
import os
from types import SimpleNamespace

import pytest
import torch

import engine
import formats
import kernels
import loading
import model
import platforms
from test_engine import save, tiny
from test_model import write_mixed_gguf
from cpu import native, store, weight_cache

IDS = torch.tensor([1, 5, 2, 9, 3, 3, 0, 7])
FORMATS = [f for f in formats.FORMATS if f != "w4a8" or native.library()[0] is not None]


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRET", False)


@pytest.fixture(params=["gguf", "hf"])
def model_file(request, tmp_path):
    """A GGUF file (4-bit and 6-bit blocks, v among them, a tied F32 embedding, q/k/v biases) or a Hugging Face
    directory (a separate head), each small enough for every format's tiles."""
    if request.param == "gguf":
        return str(write_mixed_gguf(tmp_path / "m.gguf", "qwen2", v="Q6_K"))
    return save(tiny(0, vocab=32, head_dim=32), tmp_path / "hf")


def logits(m):
    cache = model.KVCache(m.config, 1, len(IDS), 1, "cpu", m.embed.dtype)
    return m.prefill(IDS, cache, logits="all")


def built(path, fmt="int4", role="target", wider=True):
    """-> (weight_cache.build's Transformer of path, the lines it said)."""
    lines = []
    m = weight_cache.build(path, loading.open_weights(path), role, fmt, wider, lines.append, platforms.Cpu("cpu"))
    return m, lines


def kept_files():
    folder = os.path.join(store.cache_folder(), "weights")
    return sorted(os.listdir(folder))


def assert_same_model(got, want):
    """The same parameters' bytes, each matmul weight of the same kind, and the same logits, bit for bit."""
    assert torch.equal(logits(got), logits(want))
    assert got.weight_bytes() == want.weight_bytes() and got.num_params() == want.num_params()
    for (name, m, attr), (_, n, _) in zip(formats.matmuls(got), formats.matmuls(want)):
        a, b = getattr(m, attr), getattr(n, attr)
        assert type(a) is type(b) and getattr(a, "fmt", None) == getattr(b, "fmt", None), name
        assert getattr(a, "is_mkldnn", False) == getattr(b, "is_mkldnn", False), name
    assert (got.lm_head is got.embed) == (want.lm_head is want.embed)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_second_load_reads_back_the_first_builds_model(model_file, fmt):
    first, lines = built(model_file, fmt)
    assert len(lines) == 1 and lines[0].startswith("weights kept in ") and "the next start reads it back" in lines[0]
    second, lines = built(model_file, fmt)
    assert lines == [f"weights read back from {weight_cache.cache_path(model_file, fmt, 'target')}"]
    assert_same_model(second, first)
    assert_same_model(second, platforms.load(model_file, weights=fmt)[0])


def test_bf16_that_onednn_cannot_pack_is_kept_plain_and_its_tied_head_is_the_embedding(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    path = str(write_mixed_gguf(tmp_path / "m.gguf", "llama"))
    first, _ = built(path, "bf16")
    assert first.lm_head is first.embed and not first.layers[0].wo.is_mkldnn
    second, lines = built(path, "bf16")
    assert lines[0].startswith("weights read back")
    assert_same_model(second, first)


def test_the_kept_file_is_safetensors_with_its_key_and_aligned_tensors(tmp_path):
    from safetensors import safe_open
    path = str(write_mixed_gguf(tmp_path / "m.gguf", "qwen2"))
    fmt = "w4a8" if native.library()[0] else "int4"
    m, _ = built(path, fmt)
    where = weight_cache.cache_path(path, fmt, "target")
    tensors, _ = weight_cache.kept_tensors(m)
    with safe_open(where, "pt") as f:
        key = json.loads(f.metadata()["key"])
        assert key == weight_cache.cache_key(path, loading.open_weights(path).config, fmt, True)
        assert {n for n in f.keys() if not n.startswith("pad.")} == set(tensors)
        for name in tensors:
            assert torch.equal(f.get_tensor(name), tensors[name]), name
    header, _, start = weight_cache.read_header(weight_cache.mapped(where))
    assert start % weight_cache.ALIGN == 0
    tensor_entries = [entry for name, entry in header.items() if not name.startswith("pad.")]
    assert all(entry["data_offsets"][0] % weight_cache.ALIGN == 0 for entry in tensor_entries)


def test_target_and_draft_roles_and_formats_keep_one_file_each(tmp_path):
    path = str(write_mixed_gguf(tmp_path / "m.gguf", "qwen2"))
    built(path, "int4")
    built(path, "int4", role="draft", wider=False)
    built(path, "bf16")
    assert len(kept_files()) == 3


@pytest.mark.parametrize("change", ["time", "content"])
def test_a_changed_model_file_is_converted_again_and_replaces_its_entry(tmp_path, change):
    path = str(write_mixed_gguf(tmp_path / "m.gguf", "qwen2"))
    built(path)
    if change == "time":
        os.utime(path, ns=(0, os.stat(path).st_mtime_ns + 10**9))
    else:
        with open(path, "r+b") as f:  # the last weight's last bytes: the size stays
            f.seek(-4, os.SEEK_END)
            f.write(b"\x01\x02\x03\x04")
    second, lines = built(path)
    where = weight_cache.cache_path(path, "int4", "target")
    assert lines[0] == f"{where} is stale (the model file changed): converting again, replacing it"
    assert len(lines) == 2 and lines[1].startswith("weights kept in ")
    assert kept_files() == [os.path.basename(where)]
    assert_same_model(second, platforms.load(path, weights="int4")[0])
    assert built(path)[1][0].startswith("weights read back")


def test_a_cache_of_another_code_version_is_converted_again(tmp_path, monkeypatch):
    path = str(write_mixed_gguf(tmp_path / "m.gguf", "qwen2"))
    built(path)
    monkeypatch.setattr(weight_cache, "code_digest", lambda: "another version")
    _, lines = built(path)
    assert lines[0].endswith(" is stale (other code): converting again, replacing it")
    assert built(path)[1][0].startswith("weights read back")


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "header too long", "tensor missing"])
def test_a_damaged_cache_file_gives_one_line_and_a_normal_load(tmp_path, damage):
    path = str(write_mixed_gguf(tmp_path / "m.gguf", "qwen2"))
    built(path)
    where = weight_cache.cache_path(path, "int4", "target")
    with open(where, "rb") as f:
        data = f.read()
    length = int.from_bytes(data[:8], "little")
    if damage == "truncated":
        data = data[:len(data) // 2]
    elif damage == "garbage":
        data = os.urandom(4096)
    elif damage == "empty":
        data = b""
    elif damage == "header too long":
        data = (10**12).to_bytes(8, "little") + data[8:]
    else:  # a whole file whose header lost a parameter
        header = json.loads(data[8:8 + length])
        header["pad.norm"] = header.pop("norm")
        text = json.dumps(header).encode().ljust(length)
        data = data[:8] + text + data[8 + length:]
    with open(where, "wb") as f:
        f.write(data)
    m, lines = built(path)
    assert lines[0].startswith(f"{where} is unreadable or truncated (") and lines[0].endswith(
        f"): loading {path} as usual, replacing it")
    assert len(lines) == 2 and lines[1].startswith("weights kept in ")
    assert_same_model(m, platforms.load(path, weights="int4")[0])
    assert built(path)[1][0].startswith("weights read back")


def no_temporaries():
    return not [n for n in kept_files() if n.endswith(".tmp")]


def test_a_read_only_cache_folder_gives_one_line_and_a_normal_load(tmp_path, monkeypatch):
    path = str(write_mixed_gguf(tmp_path / "m.gguf", "qwen2"))
    folder = os.path.join(store.cache_folder(), "weights")
    os.makedirs(folder)
    os.chmod(folder, 0o555)
    if os.geteuid() == 0:  # root writes anyway: the refusal a read-only folder gives anyone else
        def refused(*args, dir=None, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied", dir)
        monkeypatch.setattr(store.tempfile, "mkstemp", refused)
    m, lines = built(path)
    os.chmod(folder, 0o755)
    where = weight_cache.cache_path(path, "int4", "target")
    assert lines == [f"weights not kept: cannot write {where} (Permission denied); the next start converts again"]
    assert kept_files() == []
    assert_same_model(m, platforms.load(path, weights="int4")[0])


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_write_leaves_no_file_and_no_temporary(tmp_path, monkeypatch, failure):
    path = str(write_mixed_gguf(tmp_path / "m.gguf", "qwen2"))

    def fails(*args):
        raise failure
    monkeypatch.setattr(weight_cache.os, "replace", fails)
    if isinstance(failure, KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            built(path)
    else:
        m, lines = built(path)
        assert lines == [f"weights not kept: cannot write {weight_cache.cache_path(path, 'int4', 'target')} (No "
                         "space left on device); the next start converts again"]
    assert kept_files() == []


def test_too_little_free_disk_writes_nothing(tmp_path, monkeypatch):
    path = str(write_mixed_gguf(tmp_path / "m.gguf", "qwen2"))
    monkeypatch.setattr(weight_cache.shutil, "disk_usage", lambda folder: SimpleNamespace(free=10**6))
    _, lines = built(path)
    assert len(lines) == 1 and "GB free" in lines[0] and lines[0].endswith("the next start converts again")
    assert kept_files() == []


def test_the_engine_reads_its_pair_back(tmp_path):
    target = save(tiny(0, vocab=32, head_dim=32), tmp_path / "target")
    draft = save(tiny(1, vocab=32, head_dim=32), tmp_path / "draft")
    texts = []
    for _ in range(2):
        lines = []
        e = engine.Engine(target, draft, weights="int4", on_line=lines.append).load()
        texts.append(e.generate("w1 w2 w3", method="sd", temperature=0, max_new_tokens=8).text)
    assert sum(line.startswith("weights read back from") for line in lines) == 2
    assert texts[0] == texts[1]
