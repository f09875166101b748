"""What the CPU wing keeps on disk shares: the cache folder, this machine's identity (its CPU, read once), one atomic
write, and the errors a kept file may raise when read back."""
import contextlib
import functools
import hashlib
import os
import platform
import struct
import tempfile

CACHE_ENV = "SMCSD_MINI_CACHE"  # a folder in place of the user's cache directory's (tests set it)
# What reading back a kept file may raise where it is not whole, not JSON or not this code's: each gives a line and
# a fresh measurement or conversion, never a traceback.
UNREADABLE = (OSError, ValueError, KeyError, IndexError, TypeError, RuntimeError, AttributeError, struct.error)


def cache_folder():
    """$SMCSD_MINI_CACHE, else smcsd-mini in the user's cache directory (XDG's)."""
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "smcsd-mini")


@contextlib.contextmanager
def atomically(path):
    """-> a temporary path beside path, renamed over it when the block ends and removed when it fails: a reader
    finds the old file or the new one, whole (KeyboardInterrupt included)."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=".kept-", suffix=".tmp")
    os.close(handle)
    try:
        yield temporary
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def digest(text):
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.cache
def cpu():
    """-> {"name": this CPU's model name, "flags": [its feature flags, as /proc/cpuinfo lists them]}, the first
    core's, read once (/proc/cpuinfo; platform's name and no flags where there is none)."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                field, _, value = line.partition(":")
                info.setdefault(field.strip(), value.strip())  # the first core's
    except OSError:
        pass
    name = info.get("model name") or platform.processor() or platform.machine()
    return {"name": name, "flags": (info.get("flags") or info.get("Features", "")).split()}


def cpu_identity():
    """-> {"cpu": this CPU's model name, "flags": a digest of its feature flags}: what kept choices and weights
    depend on."""
    info = cpu()
    return {"cpu": info["name"], "flags": digest(" ".join(info["flags"]))}


def file_identity(path):
    """-> {"path": path's real path, "files": [[name, bytes, mtime in ns]]}: a .gguf file's, or a directory's weights,
    config and tokenizer files'; any change to them gives another identity."""
    path = os.path.realpath(path)
    folder = os.path.dirname(path)
    names = [os.path.basename(path)]
    if os.path.isdir(path):
        folder = path
        names = sorted(n for n in os.listdir(path) if n.endswith((".safetensors", ".json", ".gguf")))
    files = []
    for name in names:
        stat = os.stat(os.path.join(folder, name))
        files.append([name, stat.st_size, stat.st_mtime_ns])
    return {"path": path, "files": files}
