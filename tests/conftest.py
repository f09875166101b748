import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter, which must be chosen before any @triton.jit
# function is defined, i.e. before anything imports kernels.py. On a GPU they run compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Nothing in the suite asks the Hugging Face Hub: a Hub id is read from a cache a test lays out (test_hub.py).
os.environ["HF_HUB_OFFLINE"] = "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what the tests build or keep (native's compiled kernel at collection, auto's choices) never goes to the user's
# cache directory; each test gets a folder of its own below (measurement_cache)
os.environ["SMCSD_MINI_CACHE"] = tempfile.mkdtemp(prefix="smcsd-tests-")
sys.path.insert(0, ROOT)
DRY_RUN = pytest.StashKey()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a test the edit loop skips (python -m pytest -m 'not slow' tests)")


def pytest_collection_finish(session):
    """When test_model.py's dry-run test is to run, pip starts now, beside the tests before it: it needs nothing
    from them, and they, mostly on one thread, leave the second core idle for its ~20 s. It resolves
    requirements-test.txt as a fresh install from wheels alone (a package with only a source distribution fails)."""
    if any(item.nodeid.endswith("::test_requirements_install_without_compiling") for item in session.items):
        folder = tempfile.mkdtemp()
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                   "--only-binary", ":all:", "-r", os.path.join(ROOT, "requirements-test.txt"), "--report",
                   os.path.join(folder, "report.json")]
        session.config.stash[DRY_RUN] = (subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                           text=True), folder)


def pytest_sessionfinish(session):
    if DRY_RUN in session.config.stash:
        run, folder = session.config.stash[DRY_RUN]
        run.kill()
        run.communicate()
        shutil.rmtree(folder)


@pytest.fixture(autouse=True)
def measurement_cache(tmp_path_factory, monkeypatch):
    """--weights auto keeps its choices in a folder of each test's own, never in the user's cache directory."""
    monkeypatch.setenv("SMCSD_MINI_CACHE", str(tmp_path_factory.mktemp("auto-cache")))


@pytest.fixture
def requirements_dry_run(request):
    """-> (exit status, stderr, path of the report) of pip's dry run, started with the session."""
    run, folder = request.config.stash[DRY_RUN]
    _, err = run.communicate(timeout=600)
    return run.returncode, err, os.path.join(folder, "report.json")
