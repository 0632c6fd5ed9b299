"""Command line: `specjax-convert gguf-to-hf IN.gguf OUT_DIR` and `specjax-convert hf-to-orbax HF_DIR OUT_DIR`."""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

DTYPE_CHOICES = ("float32", "bfloat16", "float16")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjax-convert", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gguf = commands.add_parser("gguf-to-hf", help="dequantize a llama.cpp GGUF file into an HF directory")
    gguf.add_argument("gguf_file")
    gguf.add_argument("out_dir")
    gguf.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    orbax = commands.add_parser("hf-to-orbax", help="convert an HF safetensors directory to a specjax orbax "
                                                    "checkpoint")
    orbax.add_argument("hf_dir")
    orbax.add_argument("out_dir")
    orbax.add_argument("--dtype", default="auto", choices=("auto",) + DTYPE_CHOICES,
                       help="saved dtype (auto: config.json's torch_dtype)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = run(args)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(out)
    return 0


def run(args: argparse.Namespace):
    # Imported here so `--help` answers without loading JAX.
    if args.command == "gguf-to-hf":
        from checkpoints_conv.gguf_to_hf import convert_gguf_to_hf
        return convert_gguf_to_hf(args.gguf_file, args.out_dir, dtype=args.dtype)
    from checkpoints_conv.orbax_io import convert_hf_to_orbax
    return convert_hf_to_orbax(args.hf_dir, args.out_dir, dtype=args.dtype)
