"""Checkpoint conversion: HF safetensors -> Flax param trees, GGUF -> HF directories, orbax save/restore."""
from checkpoints_conv.gguf_to_hf import convert_gguf_to_hf
from checkpoints_conv.orbax_io import (convert_hf_to_orbax, is_orbax_checkpoint, load_checkpoint, restore_params,
                                       save_params)
from checkpoints_conv.safetensors_loader import LeafSpec, hf_name_map, load_params

__all__ = ["LeafSpec", "convert_gguf_to_hf", "convert_hf_to_orbax", "hf_name_map", "is_orbax_checkpoint",
           "load_checkpoint", "load_params", "restore_params", "save_params"]
