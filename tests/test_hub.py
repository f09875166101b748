"""Models by their Hugging Face Hub ids (loading.local_paths): read from a Hugging Face cache that each test lays out
on disk as huggingface_hub does, offline; where a test needs the Hub, a stand-in answers for it. Nothing here, nor
in the rest of the suite (conftest.py sets HF_HUB_OFFLINE), reaches the network."""
import hashlib
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

import cli
import engine
import errors
import loading
from test_engine import pair, reference_kernels  # noqa: F401 (fixtures)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMIT = "0123456789abcdef0123456789abcdef01234567"
GGUFS = ["m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-Q8_0.gguf"]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A Hugging Face cache of the test's own (HF_HUB_CACHE) and no Hub (HF_HUB_OFFLINE) -> put(repo, {name: its
    bytes or a file to copy}, revision, commit) -> the snapshot folder, laid out as huggingface_hub writes it: each
    file a blob named by its hash, the snapshot's links to the blobs, refs/<revision> naming the commit."""
    from huggingface_hub import constants
    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def put(repo, files, revision="main", commit=COMMIT):
        folder = cache / f"models--{repo.replace('/', '--')}"
        snapshot = folder / "snapshots" / commit
        for name, data in files.items():
            if not isinstance(data, bytes):
                with open(data, "rb") as f:
                    data = f.read()
            blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = snapshot / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / revision).write_text(commit)
        return str(snapshot)
    return put


def directory(path):
    """{name: path} of a model directory's files."""
    return {name: os.path.join(path, name) for name in os.listdir(path)}


def test_a_hub_id_is_read_from_the_cache_offline(hub, pair, capsys):  # noqa: F811 (the fixture)
    """--target org/name and --draft org/name decode from the Hugging Face cache as their directories do."""
    target = hub("org/target", directory(pair[0]))
    draft = hub("org/draft", directory(pair[1]))
    assert loading.local_paths(["org/target", "org/draft", None]) == [target, draft, None]
    assert engine.Engine("org/target", "org/draft", weights="bf16").paths == [target, draft]
    runs = []
    for models in (["org/target", "org/draft"], list(pair)):
        cli.main(["--target", models[0], "--draft", models[1], "--prompt", "w1 w2 w3", "--json", "--weights",
                     "bf16", "--method", "sd", "--max-new-tokens", "6", "--seed", "3"])
        runs.append(json.loads(capsys.readouterr().out)["tokens"])
    assert runs[0] == runs[1] and runs[0]


def test_a_revision_is_a_ref_or_a_commit(hub, pair):  # noqa: F811 (the fixture)
    snapshot = hub("org/target", directory(pair[0]), revision="v1")
    assert loading.local_paths(["org/target@v1", f"org/target@{COMMIT}"]) == [snapshot, snapshot]
    with pytest.raises(errors.LoadError, match="HF_HUB_OFFLINE"):
        loading.local_paths(["org/target"])  # main is not cached


def test_a_gguf_file_by_name_by_quant_tag_or_llama_cpps_default(hub):
    snapshot = hub("org/m-GGUF", dict.fromkeys(GGUFS, b"GGUF"))
    cases = {"org/m-GGUF:m-Q8_0.gguf": "m-Q8_0.gguf", "org/m-GGUF:q8_0": "m-Q8_0.gguf",
             "org/m-GGUF:Q4_K_S": "m-Q4_K_S.gguf", "org/m-GGUF": "m-Q4_K_M.gguf"}
    for name, file in cases.items():
        assert loading.local_paths([name]) == [os.path.join(snapshot, file)], name
    with pytest.raises(errors.LoadError) as error:
        loading.local_paths(["org/m-GGUF:Q4_K"])
    assert str(error.value) == ("org/m-GGUF:Q4_K: 2 GGUF files of org/m-GGUF match q4_k (m-Q4_K_M.gguf, "
                                "m-Q4_K_S.gguf): name one as org/m-GGUF:FILE")


def test_a_gguf_from_the_cache_loads(hub, tmp_path):
    from test_model import write_mixed_gguf
    path = write_mixed_gguf(tmp_path / "m.gguf", "qwen2")
    snapshot = hub("org/mixed", {"mixed-Q4_K_M.gguf": path})
    e = engine.Engine("org/mixed:mixed-Q4_K_M.gguf", weights="float32")
    assert e.paths == [os.path.join(snapshot, "mixed-Q4_K_M.gguf"), None]
    assert e.config == loading.open_weights(path)[0]


def test_a_local_path_wins_and_a_missing_one_stays_a_path(hub, pair, tmp_path, monkeypatch):  # noqa: F811
    hub("org/target", directory(pair[0]))
    monkeypatch.chdir(tmp_path)
    os.makedirs("org")
    os.symlink(pair[1], "org/target")  # a folder that reads as a Hub id, the draft's
    assert loading.local_paths(["org/target", "weights/missing.gguf", "./org/x"]) == [
        "org/target", "weights/missing.gguf", "./org/x"]
    with pytest.raises(errors.LoadError, match=r"^weights/missing.gguf: no such file or directory$"):
        engine.Engine("weights/missing.gguf")


def test_not_in_the_cache_offline_is_one_line_before_anything_heavy(hub, pair, monkeypatch, capsys):  # noqa: F811
    from huggingface_hub import constants
    monkeypatch.setattr(loading, "open_weights", lambda path: pytest.fail("a model was opened"))
    with pytest.raises(SystemExit) as exit:
        cli.main(["--target", "org/missing", "--draft", pair[1], "--prompt", "w1"])
    assert str(exit.value.code) == (f"error: org/missing: no such file or directory, nor in the Hugging Face cache "
                                    f"({constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE is set: unset HF_HUB_OFFLINE to "
                                    "download it, or give the path of a model directory or .gguf file")
    assert capsys.readouterr() == ("", "")


def test_an_incomplete_cached_directory_is_not_taken(hub, pair):  # noqa: F811 (the fixture)
    """A snapshot with the config alone (as a config-only look-up leaves it) is not the model."""
    hub("org/target", {"config.json": os.path.join(pair[0], "config.json")})
    with pytest.raises(errors.LoadError, match="nor in the Hugging Face cache"):
        loading.local_paths(["org/target"])


# ---------------------------------------------------------------- the Hub, stood in for


def hub_answers(monkeypatch, files=None, error=None):
    """The Hub as a stand-in: model_info lists files {name: size} (or raises error); downloads are recorded."""
    import huggingface_hub
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls = []

    def model_info(self, repo, revision=None, files_metadata=False, timeout=None):
        if error:
            raise error
        return SimpleNamespace(siblings=[SimpleNamespace(rfilename=f, size=s) for f, s in files.items()])

    def hf_hub_download(repo, file, revision=None):
        calls.append((repo, revision, [file]))
        return f"/cache/{file}"

    def snapshot_download(repo, revision=None, allow_patterns=None, local_files_only=False):
        if local_files_only:
            raise FileNotFoundError
        calls.append((repo, revision, allow_patterns))
        return "/cache/snapshot"
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_a_download_takes_only_the_files_read_and_says_so(monkeypatch, capsys):
    files = {"config.json": 700, "tokenizer.json": 7_000_000, "tokenizer_config.json": 7000,
             "model-00001-of-00002.safetensors": 2_000_000_000, "model-00002-of-00002.safetensors": 1_000_000_000,
             "model.safetensors.index.json": 30_000, "pytorch_model.bin": 3_000_000_000, "README.md": 5000,
             "onnx/model.onnx": 10**9, "m-Q4_K_M.gguf": 10**9}
    calls = hub_answers(monkeypatch, files)
    assert loading.local_paths(["org/big@v2"]) == ["/cache/snapshot"]
    wanted = ["config.json", "tokenizer.json", "tokenizer_config.json", "model-00001-of-00002.safetensors",
              "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    assert calls == [("org/big", "v2", wanted)]  # never the pickle, nor the GGUF a directory has beside it
    from huggingface_hub import constants
    assert capsys.readouterr().err == (f"org/big@v2: downloading 6 file(s), 3,007 MB, from the Hugging Face Hub into "
                                       f"{constants.HF_HUB_CACHE}\n")
    calls.clear()
    assert loading.local_paths(["org/big:Q4_K_M"]) == ["/cache/m-Q4_K_M.gguf"]
    assert calls == [("org/big", None, ["m-Q4_K_M.gguf"])]


def test_every_id_is_found_before_any_is_downloaded(monkeypatch):
    calls = hub_answers(monkeypatch, {"m-Q8_0.gguf": 10, "m-Q6_K.gguf": 12})
    with pytest.raises(errors.LoadError, match="no GGUF file of org/m has Q4_K_M"):
        loading.local_paths(["org/m:m-Q8_0.gguf", "org/m"])
    assert calls == []


def http_error(kind):
    from huggingface_hub import errors
    return getattr(errors, kind)("stand-in", response=SimpleNamespace(headers={}, request=None))


@pytest.mark.parametrize("files, error, message", [
    ({"pytorch_model.bin": 10, "config.json": 1, "tokenizer.json": 1}, None,
     "org/m: org/m has neither config.json, tokenizer.json and *.safetensors nor a .gguf file (pickled .bin/.pt "
     "weights are never loaded)"),
    ({"a-Q8_0.gguf": 1}, None, "org/m:b.gguf: org/m has no file b.gguf; its GGUF files: a-Q8_0.gguf; name one as "
     "org/m:FILE"),
    (None, "RepositoryNotFoundError", "org/m: no such file or directory, nor a model on the Hub (a private one needs "
     "HF_TOKEN); or give the path of a model directory or .gguf file"),
    (None, "GatedRepoError", "org/m: org/m is gated: accept its terms on the Hub and set HF_TOKEN, or give the path "
     "of a model directory or .gguf file"),
    (None, "RevisionNotFoundError", "org/m@v9: org/m has no revision 'v9'"),
], ids=["pickles", "no such file", "no such repo", "gated", "no such revision"])
def test_what_the_hub_lacks_is_one_line(monkeypatch, files, error, message):
    hub_answers(monkeypatch, files, error and http_error(error))
    name = message.split(": ")[0]
    with pytest.raises(errors.LoadError) as raised:
        loading.local_paths([name])
    assert str(raised.value) == message


def test_an_unreachable_hub_is_one_line(monkeypatch):
    from huggingface_hub import constants
    hub_answers(monkeypatch, error=ConnectionError("Name or service not known"))
    with pytest.raises(errors.LoadError) as error:
        loading.local_paths(["org/m"])
    assert str(error.value) == (f"org/m: no such file or directory, nor in the Hugging Face cache "
                                f"({constants.HF_HUB_CACHE}), and the Hub cannot be reached (ConnectionError): fetch "
                                "it into that cache where the Hub is reachable (HF_HUB_OFFLINE=1 reads it without "
                                "asking), or give the path of a model directory or .gguf file")


@pytest.mark.slow
def test_the_command_line_reads_a_hub_id_from_the_cache_with_the_environments_settings(hub, pair, tmp_path):  # noqa
    """engine.py as a user runs it, HF_HUB_CACHE and HF_HUB_OFFLINE in its environment."""
    hub("org/target", directory(pair[0]))
    env = os.environ | {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    runs = []
    for target in ("org/target", pair[0]):
        run = subprocess.run([sys.executable, "engine.py", "--target", target, "--method", "ar", "--weights", "float32",
                              "--prompt", "w1 w2", "--max-new-tokens", "3", "--seed", "1", "--json"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        runs.append(json.loads(run.stdout))
    assert runs[0]["tokens"] == runs[1]["tokens"] and runs[0]["stats"]["stop"] == runs[1]["stats"]["stop"]
    missing = subprocess.run([sys.executable, "engine.py", "--target", "org/missing"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.startswith("error: org/missing: no such file or directory, nor in the Hugging Face cache")
    assert missing.stderr.count("\n") == 1
