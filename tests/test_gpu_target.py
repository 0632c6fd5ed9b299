"""Compiling for an H200 on a host without a GPU (benchmarks/gpu_target.py): the Pallas kernels assemble for sm_90a
without spilling registers, and the generate loops compile with the launches the device runs. Interpret mode and
Triton's own verifier (test_kernels_lower_for_gpu.py) stop before ptxas, where register pressure and shared
memory first show. Needs the CUDA plugin and ptxas, which the test install leaves out (about 800 MB): skipped
without them (`pip install -e ".[gpu-compile]"`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_target import missing

pytestmark = pytest.mark.skipif(missing() is not None, reason=f"compiling for a GPU here: {missing()}")
ROOT = Path(__file__).resolve().parents[1]


def run_for_h200(tmp_path: Path, *args: str) -> None:
    """A benchmark module in its own process: the plugin loads only where jax starts with these settings."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", OUT=str(tmp_path),
               PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, *args], cwd=ROOT, env=env, check=True, timeout=900)


def test_the_kernels_assemble_without_spilling_a_tree_costs_the_causal_pass_code_and_fp8_converts_once(tmp_path):
    run_for_h200(tmp_path, "-m", "benchmarks.gpu_target", "--smoke")
    rows = json.loads((tmp_path / "gpu_target_kernels.json").read_text())["rows"]
    reports = {(row["case"], row["kernel"]): row for row in rows}
    assert len(reports) == len(rows) == 5 and all(row["spill_bytes"] == 0 for row in rows), rows
    tree, causal = (reports[f"default model attention, {case}", "specjax_decode_attention"]
                    for case in ("tree of 32", "causal pass of 33"))
    # The tree's mask is bits tested in the one block loop: no second loop, no gathered loads.
    assert tree["matrix_ops"] == causal["matrix_ops"]
    assert tree["global_copies"] == causal["global_copies"]
    # bf16 rows meet FP8 experts as float16: one packed conversion per two codes, none per element into bf16.
    experts = reports["V3 experts, 32 FP8, 8 rows", "specjax_grouped_matmul"]
    assert all(".f16.f16." in op for op in experts["matrix_ops"]), experts
    assert set(experts["conversions"]) == {"cvt.rn.f16x2.e4m3x2"}, experts


def test_the_loops_compile_speculation_leaves_the_targets_pass_as_it_is_and_adapting_costs_no_memory(tmp_path):
    run_for_h200(tmp_path, "benchmarks/bench_eagle.py", "--target", "h200", "--smoke", "--methods", "eagle3",
                 "--mtp", "", "--dtype", "bfloat16", "--policy", "fixed,auto")
    profiles = {p["engine"]: p for p in json.loads((tmp_path / "bench_eagle_target.json").read_text())["rows"]}
    fixed = ["specjax plain", "specjax eagle3 k=3", "specjax eagle3 tree 4:2:2"]
    assert set(profiles) == {*fixed, "specjax eagle3 k=3 auto", "specjax eagle3 tree 4:2:2 auto"}
    # The H200's profiler counted 260-261 kernels per token of this loop (263 launches compiled).
    assert 200 <= profiles["specjax plain"]["launches_per_iteration"] <= 300
    target = [next(c["launches"] for c in profiles[name]["launches_by_loop_call"]
                   if c["function"].startswith("models/llama.py")) for name in fixed]
    assert max(target) - min(target) <= 5, target
    # Choosing a tier copies no buffer: a switch over the tiers had copied the KV caches (temporaries +39%).
    for name in ("eagle3 k=3", "eagle3 tree 4:2:2"):
        assert profiles[f"specjax {name} auto"]["temp_bytes"] <= 1.01 * profiles[f"specjax {name}"]["temp_bytes"]


def test_deepseek_v3s_fp8_step_compiles_with_its_projections_in_the_grouped_kernel(tmp_path):
    run_for_h200(tmp_path, "benchmarks/bench_deepseek.py", "--target", "h200", "--smoke", "--forms", "kernel,xla")
    row, xla = json.loads((tmp_path / "bench_deepseek_v3_target.json").read_text())["rows"]
    assert (row["form"], xla["form"]) == ("kernel", "xla")
    kernel = row["by_function"].get("kernels/grouped_matmul_triton.py:grouped_matmul_triton", 0)
    # Per layer at least q_a, q_b, kv_a and o (the FP8 matrices below a scale block's rows), and the experts.
    assert kernel >= 4 * 2, row
    assert "kernels/grouped_matmul_triton.py:grouped_matmul_triton" not in xla["by_function"], xla
