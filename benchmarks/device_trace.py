"""What ran on the GPU, and for how long: kernel events read back from a jax.profiler trace.

Wall-clock timing of a kernel of tens of microseconds through back-to-back jitted calls carries each call's
dispatch, as much as the kernel itself (RESULTS.md, bench_attention run 4); the profiler's device events are
the kernels' own durations. Off GPUs there are no device events, so device times are NaN there (a CPU
--smoke run). Run with `--xla_enable_command_buffers_during_profiling=true` in XLA_FLAGS when the trace
must show the loop as it runs unprofiled (XLA otherwise leaves CUDA graphs off while tracing).
"""
from __future__ import annotations

import collections
import dataclasses
import re
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
from jax.profiler import ProfileData


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    op: str            # the HLO instruction it belongs to ('' when the trace does not say)
    start_ns: float
    duration_ns: float


def traced_kernels(run: Callable[[], object], keep_trace: Path | None = None) -> list[Kernel]:
    """The device activity (kernels, device copies) of run() (its result blocked on), in start order. Off GPUs
    there is none: run() runs once, untraced (a trace of Pallas interpret mode's many host ops takes minutes
    to write)."""
    jax.block_until_ready(run())   # compiled and warm before tracing
    if jax.devices()[0].platform != "gpu":
        return []
    folder = Path(tempfile.mkdtemp())
    with jax.profiler.trace(str(folder)):
        jax.block_until_ready(run())
    path = next(folder.rglob("*.xplane.pb"))
    if keep_trace is not None:
        shutil.copy(path, keep_trace)
    kernels = []
    for plane in ProfileData.from_file(str(path)).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):   # derived lines (XLA Ops, Modules) repeat the kernels
                continue
            for event in line.events:
                stats = dict(event.stats)
                kernels.append(Kernel(event.name, str(stats.get("hlo_op", "")), event.start_ns,
                                      event.duration_ns))
    shutil.rmtree(folder, ignore_errors=True)
    return sorted(kernels, key=lambda k: k.start_ns)


def traced_calls(fn: Callable, *args, calls: int = 5, threaded: bool = False) -> list[Kernel]:
    """The kernels of `calls` calls of jit(fn)(*args) back to back (traced_kernels). threaded: fn returns the next
    value of its first argument, which is donated and handed on call to call (a buffer updated in place, as
    a cache is in the model, rather than copied by each call); the caller's own first argument is left as it is."""
    call = jax.jit(fn, donate_argnums=(0,) if threaded else ())
    first = [jnp.copy(args[0])] if threaded else None

    def run():
        if not threaded:
            return [call(*args) for _ in range(calls)]
        for _ in range(calls):
            first[0] = call(first[0], *args[1:])
        return first[0]

    return traced_kernels(run)


def device_us_per_call(fn: Callable, *args, calls: int = 5, threaded: bool = False) -> float:
    """Device time of one call of jit(fn)(*args): the kernels' busy time over `calls` traced calls back to
    back (traced_calls), divided by `calls`; NaN when the trace holds no kernel (off GPUs)."""
    kernels = traced_calls(fn, *args, calls=calls, threaded=threaded)
    return busy_ns(kernels) / calls / 1e3 if kernels else float("nan")


def summed_us_per_call(kernels: list[Kernel], calls: int) -> float:
    """The kernels' summed durations per call in us; NaN when there are none (off GPUs)."""
    return sum(k.duration_ns for k in kernels) / calls / 1e3 if kernels else float("nan")


def busy_ns(kernels: list[Kernel]) -> float:
    """Time at least one kernel ran (the union of their intervals)."""
    total, end = 0.0, float("-inf")
    for k in kernels:
        begin, finish = k.start_ns, k.start_ns + k.duration_ns
        if finish > end:
            total += finish - max(begin, end)
            end = finish
    return total


def span_ns(kernels: list[Kernel]) -> float:
    return max(k.start_ns + k.duration_ns for k in kernels) - kernels[0].start_ns if kernels else 0.0


def median_duration_us(kernels: list[Kernel], name_part: str) -> float:
    """Median duration of the kernels whose name contains name_part."""
    durations = [k.duration_ns for k in kernels if name_part in k.name]
    return statistics.median(durations) / 1e3 if durations else float("nan")


def by_kernel(kernels: list[Kernel], per: int = 1, top: int = 25) -> list[dict]:
    """Total time and count per kind of kernel (its name, numeric suffix dropped: inside a CUDA graph every
    kernel's op is the graph's), largest first, divided by `per` (e.g. the loop iterations traced)."""
    groups: dict[str, list[float]] = collections.defaultdict(list)
    for k in kernels:
        groups[re.sub(r"[._]\d+$", "", k.name)].append(k.duration_ns)
    rows = [dict(kernel=name, count=len(d) / per, us=sum(d) / per / 1e3) for name, d in groups.items()]
    return sorted(rows, key=lambda r: -r["us"])[:top]
