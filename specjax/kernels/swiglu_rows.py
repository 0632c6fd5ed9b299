"""An MLP's SwiGLU rows for its FP8 down projection, in one launch: the gate and up products' K-split partial sums
added up, silu(gate) * up in fp32 rounded once to bf16 (as XLA's fusion of the bf16 ops computes it, but for the
sigmoid, which is each compiler's own), and the result as the scaled float16 rows the grouped kernel takes against
an FP8 stack (grouped_matmul_triton.f16_rows). XLA's fusion of the sums and SwiGLU and the rows' own kernel were
two launches per MLP. A row is one program, so the kernel pays for narrow rows only (MAX_WIDTH). A row's result
depends on that row alone: a decode step and a verify pass round alike.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from specjax.kernels.grouped_matmul_triton import ScaledRows, store_scaled_f16

# Columns a program reads at once: the row's largest value is found over chunks, then each chunk is computed
# again and stored (the intermediate rows of an MLP are up to 18432 wide, too many to hold at once).
CHUNK = 4096
# A row is one program, so a wide row's partials are read by one SM: a dense V3 MLP's 18432 columns took 33 us of
# an H100 where XLA's fusion and f16_rows took 5 (benchmarks/RESULTS.md). Rows up to one chunk (an expert's 2048)
# are where the one launch pays.
MAX_WIDTH = CHUNK
NUM_WARPS = 16


def swiglu_rows(gate: jax.Array, up: jax.Array, interpret: bool = False) -> ScaledRows:
    """gate, up [S, M, N]: fp32 partial products over S splits of K (the grouped kernel's split_partials) ->
    silu(gate) * up [M, N] as ScaledRows: each product summed in split order and rounded to bf16, then silu and
    the product in fp32 rounded once to bf16 (XLA's fusion of jax.nn.silu(gate) * up), then f16_rows' scaling."""
    if gate.shape != up.shape or gate.ndim != 3:
        raise ValueError(f"swiglu_rows: gate and up must be alike [S, M, N], got {list(gate.shape)} and "
                         f"{list(up.shape)}")
    splits, rows, width = gate.shape
    block = min(CHUNK, pl.next_power_of_2(width))
    values, unscale = pl.pallas_call(
        functools.partial(_swiglu_rows_kernel, splits=splits, width=width, block=block),
        grid=(rows,),
        in_specs=[pl.BlockSpec(), pl.BlockSpec()],
        out_specs=[pl.BlockSpec(), pl.BlockSpec()],
        out_shape=[jax.ShapeDtypeStruct((rows, width), jnp.float16), jax.ShapeDtypeStruct((rows,), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="specjax_swiglu_rows",
    )(gate, up)
    return ScaledRows(values, unscale)


def _swiglu_rows_kernel(gate_ref, up_ref, values_ref, unscale_ref, *, splits: int, width: int, block: int) -> None:
    """One row, chunk by chunk: its SwiGLU values, scaled to float16 by their largest."""
    m = pl.program_id(0)
    chunks = pl.cdiv(width, block)

    def chunk(c):
        columns = c * block + lax.broadcasted_iota(jnp.int32, (block,), 0)
        ok = columns < width

        def summed(ref):   # unrolled: the splits' loads independent, added in split order
            parts = [plt.load(ref.at[s, m, columns], mask=ok, other=0.0) for s in range(splits)]
            return functools.reduce(jnp.add, parts).astype(jnp.bfloat16).astype(jnp.float32)

        gate, up = summed(gate_ref), summed(up_ref)
        # In fp32 to the one rounding at the end, as XLA's fusion computes the bf16 ops (its excess precision).
        return columns, ok, (gate * jax.nn.sigmoid(gate) * up).astype(jnp.bfloat16).astype(jnp.float32)

    store_scaled_f16(chunk, chunks, values_ref, unscale_ref, m)
