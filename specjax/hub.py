"""Model name -> local directory (HF layout or converted orbax checkpoint), and the tokenizer that goes with it.

Accepted names: a local directory; the default model's name (or None); a Hugging Face Hub id, fetched with
huggingface_hub's snapshot_download, which serves from the local hub cache when HF_HUB_OFFLINE=1 or the Hub
cannot be reached.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from checkpoints_conv.orbax_io import is_orbax_checkpoint
from specjax.default_model import DEFAULT_MODEL, SHIPPED_HEADS, default_model_dir, shipped_head_dir

HF_MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                  "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                  "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
LOCAL_PATH_PREFIXES = ("/", "./", "../", "~", ".")


def resolve_model(model: str | Path | None, revision: str | None = None, *,
                  allow_patterns: Sequence[str] = HF_MODEL_FILES) -> Path:
    """A local directory holding `model`'s config, weights and tokenizer files."""
    if model is None or model == DEFAULT_MODEL:
        return default_model_dir()
    if model in SHIPPED_HEADS:
        return shipped_head_dir(model)
    if not isinstance(model, (str, Path)):
        raise TypeError(f"model must be a Hub id or a directory path, got {type(model).__name__}")
    path = Path(model).expanduser()
    if path.exists() or isinstance(model, Path) or str(model).startswith(LOCAL_PATH_PREFIXES):
        return _local_model_dir(path)
    return _hub_snapshot(str(model), revision, list(allow_patterns))


def _local_model_dir(path: Path) -> Path:
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist; pass an existing directory in HF layout "
                                "(config.json, *.safetensors, tokenizer files) or a Hugging Face Hub id")
    if not (path / "config.json").is_file() and not is_orbax_checkpoint(path):
        raise FileNotFoundError(f"{path} has no config.json, so it is not a model directory; pass the directory "
                                "that holds config.json and the *.safetensors files")
    return path


def _hub_snapshot(repo_id: str, revision: str | None, allow_patterns: list[str]) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        # Offline, ask for the cache explicitly: some huggingface_hub versions otherwise try to download a
        # revision given as a commit hash even when HF_HUB_OFFLINE=1.
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=allow_patterns,
                                      local_files_only=constants.HF_HUB_OFFLINE))
    except HFValidationError as err:
        raise ValueError(f"model {repo_id!r} is neither an existing local directory nor a valid Hugging Face Hub "
                         "id (org/name); pass a local model directory or a Hub id") from err
    except (RepositoryNotFoundError, RevisionNotFoundError) as err:
        raise ValueError(f"model {repo_id!r} (revision {revision or 'main'}) was not found on the Hugging Face "
                         f"Hub ({type(err).__name__}); check the id and revision, log in for gated or private "
                         "models, or pass a local model directory") from err
    except Exception as err:  # offline, network down, partial cache: all mean "not available here"
        raise ValueError(f"model {repo_id!r} (revision {revision or 'main'}) was not found in the local Hugging "
                         f"Face cache and the Hub could not be reached ({type(err).__name__}: {err}). Pass a "
                         "local directory in HF layout, or download it once with network access") from err


def load_tokenizer(path_or_name: str | Path | None, trust_remote_code: bool = False,
                   revision: str | None = None) -> Any:
    """transformers AutoTokenizer for a model directory, Hub id or the default model."""
    from transformers import AutoTokenizer

    directory = resolve_model(path_or_name, revision)
    try:
        return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ValueError(f"no usable tokenizer in {directory} ({err}); it needs tokenizer.json or "
                         "tokenizer.model with tokenizer_config.json — pass `tokenizer=` a directory that has "
                         "them") from err
