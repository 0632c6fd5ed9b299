"""Checkpoint conversion and loading: HF safetensors -> a model family's param tree (safetensors_loader), GGUF ->
HF directories (gguf_to_hf), orbax save/restore (orbax_io), EAGLE heads in their published layouts
(eagle_loader, eagle_writer), and the `specjax-convert` command (cli).

The names below load on first use, so `specjax-convert --help` answers without loading JAX.
"""
import importlib

_PUBLIC = {"convert_gguf_to_hf": "checkpoints_conv.gguf_to_hf", "convert_hf_to_orbax": "checkpoints_conv.orbax_io",
           "is_orbax_checkpoint": "checkpoints_conv.orbax_io", "load_checkpoint": "checkpoints_conv.orbax_io",
           "restore_params": "checkpoints_conv.orbax_io", "save_params": "checkpoints_conv.orbax_io",
           "load_params": "checkpoints_conv.safetensors_loader", "load_tree": "checkpoints_conv.safetensors_loader"}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'checkpoints_conv' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
