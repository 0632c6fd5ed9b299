"""Every benchmark script's --smoke mode runs to the end on CPU and writes the JSON rows it should, so that none
rots when the library changes under it.

The scripts run as subprocesses (as they are run by hand), in two lanes side by side: each compiles on one
core, and torch is kept to one thread (on two shared cores, faster than two). The lanes share one JAX
compilation cache, so the default model's plain and EAGLE-3 loops, which bench_default_model and bench_eagle
both compile, are compiled once. The scripts of tiny random models compile without XLA's optimisations: their
programs run for microseconds, so compiling is their cost (the default model's run long enough to need them).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LANES = (("bench_default_model", "bench_eagle", "bench_transformers", "bench_projection", "bench_deepseek",
          "bench_admission"),
         ("bench_engine", "bench_tp", "bench_attention", "bench_prefill", "bench_sampling", "bench_stream",
          "bench_grouped_matmul", "bench_latent_attention", "bench_sweep", "bench_policy", "bench_row_kernels"))
SCRIPTS = sorted(name for lane in LANES for name in lane)
REAL_MODEL = ("bench_default_model", "bench_eagle")
# Scripts of the default model whose smoke runs check the script, not the model: the 4-layer chat model instead.
ON_TINY_CHAT_MODEL = ("bench_admission", "bench_stream")
# Extra arguments per script: bench_sweep's smoke run takes its profiling path too, bench_grouped_matmul's a sweep,
# bench_deepseek's V3 step its timing inside the generate loop.
ARGS = {"bench_sweep": ["--profile"], "bench_deepseek": ["--loop", "1"],
        "bench_grouped_matmul": ["--sweep", "--sweep-over", "f16_rows", "--sweep-matrices", "we_gate,wqkv_a"]}
# Extra environment per script: bench_tp splits its model over two (simulated) CPU devices.
ENV = {"bench_tp": {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}}
TIMEOUT_S = 600

ENGINE_SUITES = {"step": ("T", [1, 4]), "e2e": ("batch", [1]), "spec": ("al", [1.5, 2.5, 3.5]),
                 "sampled": ("filter", ["sort"]), "eagle": ("al", [1.5, 2.5, 3.5]), "loop": ("batch", [1]),
                 "tree": ("nodes", [4])}
# script -> {JSON file: (a key, its value in each row, in order)}
EXPECTED_ROWS = {
    "bench_default_model": {"bench_default_model_float32": ("engine", [
        "transformers generate", "transformers prompt lookup (10)", "transformers assisted (6-layer draft)",
        "specjax plain", "specjax ngram k=4", "specjax draft_model k=3 (6-layer draft)",
        "specjax eagle3 k=3 (shipped head)", "(specjax plain == transformers greedy)"])},
    "bench_eagle": {"bench_eagle": ("engine", ["specjax plain", "specjax ngram k=3", "specjax eagle3 k=3",
                                               "specjax eagle3 tree 4:2:2", "specjax mtp k=3",
                                               "specjax mtp tree 4:2:2"])},
    "bench_admission": {"bench_admission": ("mode", ["waves", "admission"])},
    "bench_transformers": {"bench_transformers": ("variant", [
        "eager generate", "assisted (1B-shaped draft)", "eager generate", "static cache (auto-compiled)",
        "static cache (auto-compiled)"])},
    "bench_projection": {"bench_projection": ("projection", [
        "norm+qkv", "o+residual", "norm+gate_up+swiglu", "down+residual"])},
    "bench_sampling": {"bench_sampling_filters": ("filter", ["top_k50", "top_p0.9", "top_k50_top_p0.9"]),
                       "bench_sampling": ("setting", ["greedy", "temperature", "top_k50", "top_p0.9", "min_p0.1"])},
    "bench_engine": {f"bench_engine_{suite}_auto": expected for suite, expected in ENGINE_SUITES.items()},
    "bench_tp": {"bench_tp": ("tp", [1, 2])},
    "bench_deepseek": {"bench_deepseek_v3_step": ("experts", ["kernel", "xla"]), "bench_deepseek_v2_e2e": ("experts", ["kernel", "xla"]),
                       "bench_deepseek_mtp": ("al", [1.5]),
                       "bench_deepseek_v2_transformers": ("engine", ["transformers generate"])},
    "bench_stream": {"bench_stream": ("mode", ["generate", "generate_stream"])},
    "bench_sweep": {"bench_sweep": ("engine", ["plain", "k=0 forced", "k=1 forced", "k=2 forced", "auto k<=2"])},
    "bench_policy": {"bench_policy": ("case", ["AL 1.1", "AL 1.15", "AL 1.2", "AL 1.5", "AL 2.0", "AL 3.0",
                                              "geometric 0.6"])},
    "bench_grouped_matmul": {"bench_grouped_matmul": ("form", ["kernel", "xla gathered", "xla ragged_dot"] * 2),
                             "bench_grouped_matmul_sweep": ("f16_rows", [False, True] * 4)},
    "bench_latent_attention": {"bench_latent_attention": ("form", ["kernel", "xla"])},
    "bench_row_kernels": {"bench_row_kernels": ("form", ["separate", "kernel"] * 3)},
    "bench_prefill": {"bench_prefill": ("shape", ["8b", "smollm2"]), "bench_prefill_model": ("tokens", [16, 32])},
}


@pytest.fixture(scope="module")
def smoke_runs(request, tmp_path_factory, tiny_chat_model):
    """The smoke runs of the scripts this session tests (a -k selection runs only those)."""
    selected = {item.callspec.params["name"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    extra_args = {name: ["--model", str(tiny_chat_model)] for name in ON_TINY_CHAT_MODEL} | ARGS
    runs = SmokeRuns([name for name in SCRIPTS if name in selected], tmp_path_factory.mktemp("smoke"), extra_args)
    yield runs
    runs.stop()


class SmokeRuns:
    """Scripts' smoke runs, started at once in their lanes (a thread per lane runs one script at a time);
    result(name) waits for one: (output folder, stdout and stderr, exit status)."""

    def __init__(self, names: list[str], root: Path, extra_args: dict[str, list[str]]):
        self._root, self._extra_args = root, extra_args
        self._results = {name: Future() for name in names}
        self._lock, self._stopped, self._running = threading.Lock(), False, []
        self._lanes = [threading.Thread(target=self._run_lane, args=([n for n in lane if n in names],))
                       for lane in LANES]
        for lane in self._lanes:
            lane.start()

    def result(self, name: str) -> tuple[Path, str, int]:
        return self._results[name].result()

    def stop(self) -> None:
        """End the runs still going, and start no other."""
        with self._lock:
            self._stopped = True
            for process in self._running:
                process.kill()
        for lane in self._lanes:
            lane.join()

    def _run_lane(self, names: list[str]) -> None:
        for name in names:
            try:
                self._results[name].set_result(self._run(name))
            except Exception as error:   # the script's test reports it
                self._results[name].set_exception(error)

    def _run(self, name: str) -> tuple[Path, str, int]:
        out = self._root / name
        out.mkdir()
        env = {**os.environ, "PYTHONPATH": str(REPO), "OUT": str(out), "OMP_NUM_THREADS": "1",
               "JAX_COMPILATION_CACHE_DIR": str(self._root / "jax_cache"),
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
               "JAX_DISABLE_MOST_OPTIMIZATIONS": "0" if name in REAL_MODEL else "1", **ENV.get(name, {})}
        with self._lock:
            if self._stopped:
                raise RuntimeError("stopped before it started")
            process = subprocess.Popen([sys.executable, f"benchmarks/{name}.py", "--smoke",
                                        *self._extra_args.get(name, [])], cwd=REPO, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self._running.append(process)
        try:
            output, _ = process.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        return out, output, process.returncode


@pytest.mark.parametrize("name", SCRIPTS)
def test_smoke_run_exits_0_and_writes_its_results(smoke_runs, name):
    out, output, status = smoke_runs.result(name)
    assert status == 0, f"{name} --smoke exited {status}:\n{output[-4000:]}"
    if name == "bench_attention":
        check_attention(json.loads((out / "bench_attention.json").read_text()))
        return
    for file, (key, values) in EXPECTED_ROWS[name].items():
        rows = json.loads((out / f"{file}.json").read_text())["rows"]
        assert [row[key] for row in rows] == values, file
    if name == "bench_deepseek":
        v3_rows = json.loads((out / "bench_deepseek_v3_step.json").read_text())["rows"]
        assert all(row["loop_ms"] > 0 and row["loop_roofline_frac"] > 0 for row in v3_rows), v3_rows


def check_attention(results: dict) -> None:
    """bench_attention writes sections rather than rows: the kernel checks, the compiled program, the tables."""
    assert results["correctness"] and all(case["ok"] for case in results["correctness"])
    assert results["compiled"]["auto"]["no_layer_copy"]
    assert isinstance(results["jax_flash_decoding"], list), results["jax_flash_decoding"]
    assert [(row["batch"], row["tokens"], row["context"]) for row in results["timings"]] == [(2, 4, 64)]


def test_every_benchmark_script_has_a_smoke_run():
    assert {path.stem for path in (REPO / "benchmarks").glob("bench_*.py")} == set(SCRIPTS)
