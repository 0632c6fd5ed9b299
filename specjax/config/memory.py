"""The "KV cache does not fit" check, made before any cache is allocated."""
from __future__ import annotations

from specjax.config.validators import check_int, check_memory_fraction


def check_kv_cache_fits(kv_bytes: int, free_bytes: int, gpu_memory_utilization: float, *,
                        max_model_len: int | None = None, max_num_seqs: int | None = None) -> None:
    """Raise a ValueError naming what to lower when the caches exceed their budget.

    kv_bytes: every cache one device holds (the target's and the proposer's); free_bytes: device memory still
    free once the weights are placed, of which the caches may use gpu_memory_utilization. kv_bytes grows
    linearly with max_model_len and with max_num_seqs; pass both to get the largest values that fit.
    """
    check_memory_fraction(gpu_memory_utilization)
    check_int(kv_bytes, "kv_bytes", minimum=0)
    check_int(free_bytes, "free_bytes", minimum=0)
    budget = int(free_bytes * gpu_memory_utilization)
    if kv_bytes <= budget:
        return
    settings = [f"{name}={value}" for name, value in (("max_num_seqs", max_num_seqs),
                                                      ("max_model_len", max_model_len)) if value is not None]
    shape = f" ({', '.join(settings)})" if settings else ""
    lines = [f"The KV cache needs {_gib(kv_bytes)}{shape}, but only {_gib(budget)} is available "
             f"({_gib(free_bytes)} free after the weights x gpu_memory_utilization={gpu_memory_utilization})."]
    fraction = budget / kv_bytes
    if max_model_len is not None:
        lines.append(f"Lower max_model_len: at most {int(max_model_len * fraction)} fits"
                     f"{f' with max_num_seqs={max_num_seqs}' if max_num_seqs else ''}.")
    if max_num_seqs is not None:
        lines.append(f"Or lower max_num_seqs: at most {int(max_num_seqs * fraction)} fit"
                     f"{f' with max_model_len={max_model_len}' if max_model_len else ''}.")
    if max_model_len is None and max_num_seqs is None:
        lines.append("Lower max_model_len or max_num_seqs.")
    if gpu_memory_utilization < 1:
        lines.append("Or raise gpu_memory_utilization (at most 1.0).")
    raise ValueError(" ".join(lines))


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"
