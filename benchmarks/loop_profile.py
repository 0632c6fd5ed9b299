"""Where one generate call's device time goes, by the specjax function that traced each kernel: a profiler trace
of the call (device_trace.py) joined with the compiled loop's stack frames (hlo_source.py), per loop iteration.

Two views: by what the engine loop called (engine/loop.py's innermost frame and the call it made: the proposer's
drafting, the target's pass, the acceptance rule, the commit) and by the innermost function (a top_k, an
rms_norm). On any platform, also the launches one iteration of the compiled loop runs (nested loops times their
trip counts), by what the loop called: on a GPU nearly its kernels, on a CPU its loops of XLA's own fusion.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from benchmarks.device_trace import Kernel, busy_ns, traced_kernels
from benchmarks.gpu_target import compiled_for
from benchmarks.hlo_source import charged_weights, instruction_stacks, launches_per_iteration
from specjax import LLM, SamplingParams
from specjax.engine.adaptive import policy_inputs
from specjax.engine.runner import Request, _spec_key

LOOP_FILE = "engine/loop.py"


def loop_profile(llm: LLM, prompt_ids: Sequence[list[int]], params: SamplingParams, top: int = 20) -> dict[str, Any]:
    """One greedy call over prompt_ids (at most the engine's slots: one wave): the launches per iteration of its
    compiled loop, by what the loop called; on a GPU also its device time per loop iteration (busy time,
    kernels, and the time and kernels charged to each function in both views). The prefill's kernels are in the
    call and so in the device figures (one pass among the iterations)."""
    inputs = [{"prompt_token_ids": ids} for ids in prompt_ids]
    outs = []
    kernels = traced_kernels(lambda: outs.append(llm.generate(inputs, params, use_tqdm=False)))
    text = compiled_loop(llm, prompt_ids, params).as_text()
    profile = loop_launches(text, top)
    if not kernels:
        return profile
    stacks = instruction_stacks(text)
    rows = [o.outputs[0] for o in outs[-1]]
    iterations = max(row.num_drafts or len(row.token_ids) for row in rows)
    return dict(profile, iterations=iterations, busy_us_per_iteration=busy_ns(kernels) / iterations / 1e3,
                kernels_per_iteration=len(kernels) / iterations,
                by_loop_call=charged(kernels, stacks, iterations, LOOP_FILE, top),
                by_function=charged(kernels, stacks, iterations, None, top))


def loop_launches(text: str, top: int = 20) -> dict[str, Any]:
    """The launches one iteration of a compiled loop (its optimized HLO) runs, in all and by what the engine loop
    called."""
    launches = launches_per_iteration(text)
    by_call = charged_weights(launches.items(), instruction_stacks(text), LOOP_FILE)
    return dict(launches_per_iteration=sum(launches.values()),
                launches_by_loop_call=[dict(function=f, launches=n) for f, n in by_call.most_common(top)])


def charged(kernels: list[Kernel], stacks: dict, per: int, caller: str | None, top: int) -> list[dict]:
    """Time (us) and kernel count per `per` charged to each function (hlo_source.charged_to), largest first;
    a kernel whose instruction the module does not name (a copy XLA added, a runtime's own) goes to "?"."""
    time = charged_weights(((k.op, k.duration_ns) for k in kernels), stacks, caller)
    count = charged_weights(((k.op, 1) for k in kernels), stacks, caller)
    return [dict(function=f, us=ns / per / 1e3, kernels=count[f] / per) for f, ns in time.most_common(top)]


def compiled_loop(llm: LLM, prompt_ids: Sequence[list[int]], params: SamplingParams,
                  device: jax.Device | None = None) -> jax.stages.Compiled:
    """The loop program one wave of these prompts runs, compiled again from the same inputs; `device`: compiled
    for that device instead (gpu_target.py: an H200 on a host without one; build the LLM under
    gpu_target.compiling_for(device))."""
    runner = llm._runner
    wave = [Request(list(ids), params, seed_index=i) for i, ids in enumerate(prompt_ids)]
    prompts, lengths, rows, cache_len = runner._pack(wave)
    key = _spec_key(wave, rows, runner.vocab_size)
    if device is not None and runner.policy is not None:   # traced step costs: any serve, and nothing runs there
        policy = policy_inputs(np.ones(len(runner.policy.tiers), np.float32))
    else:
        policy = runner._policy_inputs(None, key, rows, lengths, cache_len)   # stored by the calls before
    args = (runner.target_state, runner.draft_state, prompts, lengths, rows, cache_len, runner.synthetic_rates, policy)
    if device is not None:
        return compiled_for(runner.generate_fn(*key), args, device)
    return runner.generate_fn(*key).lower(*args).compile()
