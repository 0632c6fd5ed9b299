"""Checkpoint conversion: HF safetensors -> Flax param trees, GGUF -> HF directories, orbax save/restore."""
from checkpoints_conv.gguf_to_hf import convert_gguf_to_hf
from checkpoints_conv.orbax_io import (convert_hf_to_orbax, is_orbax_checkpoint, load_checkpoint, restore_params,
                                       save_params)
from checkpoints_conv.safetensors_loader import load_params, load_tree

__all__ = ["convert_gguf_to_hf", "convert_hf_to_orbax", "is_orbax_checkpoint", "load_checkpoint", "load_params",
           "load_tree", "restore_params", "save_params"]
