"""Model name resolution: local directories, converted checkpoints, the default model, and Hub ids served from
the local Hugging Face cache when offline."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoints_conv import convert_hf_to_orbax
from specjax.default_model import DEFAULT_MODEL
from specjax.hub import load_tokenizer, resolve_model

REPO_ROOT = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_local_directory_resolves_to_itself(tiny_checkpoint_factory):
    model_dir = tiny_checkpoint_factory("llama")
    assert resolve_model(str(model_dir)) == model_dir
    assert resolve_model(model_dir) == model_dir


def test_converted_orbax_checkpoint_is_a_model_directory(tmp_path, tiny_checkpoint_factory):
    converted = convert_hf_to_orbax(tiny_checkpoint_factory("llama"), tmp_path / "converted")
    (converted / "config.json").unlink()   # the marker alone identifies a converted checkpoint
    assert resolve_model(str(converted)) == converted


def test_local_paths_that_are_not_models(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model("./definitely/not/here")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(TypeError, match="model must be"):
        resolve_model(3)


def test_default_model_name_and_none(default_model_dir):
    assert resolve_model(DEFAULT_MODEL) == default_model_dir
    assert resolve_model(None) == default_model_dir


def test_tokenizer_of_default_model(default_model_dir):
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    ids = tokenizer("Hello world")["input_ids"]
    assert ids and tokenizer.decode(ids) == "Hello world"
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


def test_directory_without_tokenizer_is_a_clear_error(tiny_checkpoint_factory):
    with pytest.raises(ValueError, match="no usable tokenizer"):
        load_tokenizer(str(tiny_checkpoint_factory("llama")))


def fake_hub_cache(cache: Path, repo_id: str, model_dir: Path) -> Path:
    """The layout huggingface_hub's snapshot_download leaves behind: refs/main -> snapshots/<commit>/files."""
    storage = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = storage / "snapshots" / COMMIT
    shutil.copytree(model_dir, snapshot)
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(COMMIT)
    return snapshot


RESOLVE_SCRIPT = """
import json, sys
from specjax.hub import resolve_model
out = {}
for key, repo_id, revision in json.loads(sys.argv[1]):
    try:
        out[key] = ["ok", str(resolve_model(repo_id, revision))]
    except Exception as err:
        out[key] = [type(err).__name__, str(err)]
print(json.dumps(out))
"""


def resolve_offline(cache: Path, queries: list[tuple[str, str, str | None]]) -> dict:
    """Run resolve_model in a fresh process with HF_HUB_OFFLINE=1 and HF_HUB_CACHE=cache (huggingface_hub
    reads both at import)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", RESOLVE_SCRIPT, json.dumps(queries)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_hub_id_resolves_from_offline_cache(tmp_path, tiny_checkpoint_factory):
    cache = tmp_path / "hub"
    snapshot = fake_hub_cache(cache, "tiny-org/tiny-llama", tiny_checkpoint_factory("llama"))
    got = resolve_offline(cache, [("by_ref", "tiny-org/tiny-llama", None),
                                  ("by_commit", "tiny-org/tiny-llama", COMMIT),
                                  ("unknown", "tiny-org/not-cached", None),
                                  ("bad_revision", "tiny-org/tiny-llama", "v9")])
    assert got["by_ref"] == ["ok", str(snapshot)]
    assert got["by_commit"] == ["ok", str(snapshot)]
    for key, name in [("unknown", "tiny-org/not-cached"), ("bad_revision", "tiny-org/tiny-llama")]:
        kind, message = got[key]
        assert kind == "ValueError", got[key]
        assert f"model {name!r}" in message and "not found in the local Hugging Face cache" in message
        assert "Hub could not be reached" in message and "local directory" in message
