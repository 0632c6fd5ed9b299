"""Converted param trees saved and restored with orbax, so a model is renamed/transposed/cast only once.

A converted checkpoint directory keeps the HF side files (config.json, tokenizer files) next to the orbax
tree, so it can be passed anywhere a model directory is accepted:
    OUT_DIR/config.json, tokenizer files ...   copied from the HF directory (config torch_dtype = saved dtype)
    OUT_DIR/specjax_checkpoint.json            marker: format name, version, leaf shapes and dtypes
    OUT_DIR/params/                            the orbax checkpoint of the nested param tree
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

from checkpoints_conv.safetensors_loader import load_params, sharding_at
from specjax.config.dtypes import resolve_dtype
from specjax.models.registry import config_from_dir
from specjax.models.weight_map import LeafSpec
from specjax.parallel.plan import nest_paths

MARKER_FILE = "specjax_checkpoint.json"
PARAMS_DIR = "params"
FORMAT = "specjax-orbax"
VERSION = 1
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "tokenizer.model",
                 "vocab.json", "merges.txt", "added_tokens.json")


def is_orbax_checkpoint(path: str | Path) -> bool:
    return (Path(path) / MARKER_FILE).is_file()


def save_params(params: dict, out_dir: str | Path) -> Path:
    """Write params (nested dict of arrays) as OUT_DIR/params plus the marker file; OUT_DIR must be new."""
    out_dir = Path(out_dir).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out_dir / PARAMS_DIR, params)
    checkpointer.wait_until_finished()
    checkpointer.close()
    leaves = {_path_str(path): {"shape": list(leaf.shape), "dtype": np.dtype(leaf.dtype).name}
              for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    marker = {"format": FORMAT, "version": VERSION, "leaves": leaves}
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    return out_dir


def restore_params(ckpt_dir: str | Path, shardings: dict | None = None, dtype: Any = None) -> dict:
    """Restore the tree onto `shardings` (nested dict of Sharding; None = the default device), cast to dtype
    (None = as saved)."""
    ckpt_dir = Path(ckpt_dir).absolute()
    leaves = read_marker(ckpt_dir)["leaves"]
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = nest_paths({
        path: jax.ShapeDtypeStruct(tuple(meta["shape"]), dtype or np.dtype(meta["dtype"]),
                                   sharding=sharding_at(shardings, path) or default)
        for path, meta in leaves.items()})
    checkpointer = ocp.StandardCheckpointer()
    try:
        return checkpointer.restore(ckpt_dir / PARAMS_DIR, abstract)
    finally:
        checkpointer.close()


def read_marker(ckpt_dir: str | Path) -> dict:
    marker_file = Path(ckpt_dir) / MARKER_FILE
    if not marker_file.is_file():
        raise FileNotFoundError(f"{marker_file} does not exist; {ckpt_dir} is not a converted specjax checkpoint "
                                "(create one with `python -m checkpoints_conv hf-to-orbax HF_DIR OUT_DIR`)")
    marker = json.loads(marker_file.read_text())
    if marker.get("format") != FORMAT or marker.get("version") != VERSION:
        raise ValueError(f"{marker_file} describes format {marker.get('format')!r} version "
                         f"{marker.get('version')!r}; expected {FORMAT!r} version {VERSION}: re-convert it")
    return marker


def load_checkpoint(model_dir: str | Path, weight_map: Mapping[str, LeafSpec], dtype: np.dtype,
                    shardings: dict | None = None, ignored: str | None = None) -> dict:
    """Params of a model directory in either format, a converted orbax checkpoint or HF safetensors, as the
    family's weight map lays them out, in `dtype` (`ignored`: load_params')."""
    if not is_orbax_checkpoint(model_dir):
        return load_params(model_dir, weight_map, dtype, shardings, ignored)
    check_leaves_match(read_marker(model_dir)["leaves"], weight_map, model_dir)
    return restore_params(model_dir, shardings, dtype)


def check_leaves_match(leaves: dict[str, dict], weight_map: Mapping[str, LeafSpec], ckpt_dir: str | Path) -> None:
    expected = {path: list(spec.shape) for path, spec in weight_map.items()}
    saved = {path: meta["shape"] for path, meta in leaves.items()}
    if saved != expected:
        wrong = sorted(path for path in set(saved) | set(expected) if saved.get(path) != expected.get(path))
        raise ValueError(f"the orbax checkpoint in {ckpt_dir} does not match its config.json at {wrong} "
                         f"(saved {[saved.get(p) for p in wrong]}, expected {[expected.get(p) for p in wrong]}); "
                         "re-convert it")


def convert_hf_to_orbax(hf_dir: str | Path, out_dir: str | Path, dtype: str = "auto") -> Path:
    """HF safetensors directory -> converted checkpoint directory (written atomically)."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir).absolute()
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it or choose another output directory")
    family, cfg = config_from_dir(hf_dir)
    params = load_params(hf_dir, family.weight_map(cfg), resolve_dtype(dtype, cfg.torch_dtype),
                         ignored=family.ignored_tensors(cfg))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        save_params(params, tmp)
        _copy_side_files(hf_dir, tmp, np.dtype(jax.tree_util.tree_leaves(params)[0].dtype).name)
        tmp.chmod(0o755)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _copy_side_files(hf_dir: Path, out_dir: Path, saved_dtype: str) -> None:
    for name in HF_SIDE_FILES:
        if (hf_dir / name).is_file():
            shutil.copy2(hf_dir / name, out_dir / name)
    config = json.loads((out_dir / "config.json").read_text())
    config.pop("dtype", None)   # transformers 5 spelling; keep one key so "auto" means the saved dtype
    config["torch_dtype"] = saved_dtype
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _path_str(path: tuple) -> str:
    return "/".join(str(getattr(key, "key", key)) for key in path)
