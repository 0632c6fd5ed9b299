"""python -m specjax.training: train a draft head (EAGLE-3, or an MTP layer with --method mtp) for a target from
prompts (see pipeline.py)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from specjax.default_model import DEFAULT_MODEL
from specjax.training.pipeline import PipelineConfig, run


def parse_args(argv: list[str] | None = None) -> PipelineConfig:
    parser = argparse.ArgumentParser(prog="python -m specjax.training", description=__doc__)
    defaults = PipelineConfig(target=DEFAULT_MODEL, prompts="", out_dir="", work_dir="")
    parser.add_argument("--prompts", required=True, help="JSON lines with a `question` (GSM8K) or `prompt` field")
    parser.add_argument("--out", required=True, dest="out_dir", help="directory for the trained head")
    parser.add_argument("--work", required=True, dest="work_dir", help="directory for responses, features, log")
    for field in dataclasses.fields(PipelineConfig):
        if field.name in ("prompts", "out_dir", "work_dir"):
            continue
        default = getattr(defaults, field.name)
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(default), default=default,
                            help=f"(default: {default})")
    return PipelineConfig(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    result = run(parse_args(argv))
    print(json.dumps(result["evaluation"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
