"""Multi-head latent attention (DeepSeek-V2/V3) over a latent KV cache, in two equal forms.

Per token the cache keeps one row shared by all heads: [c_kv (kv_lora_rank, RMS-normalised) ; k_rope
(qk_rope_head_dim, rotated)], in one array [L, B, S, kv_lora_rank + qk_rope_head_dim] whose slot index is the
absolute position. One array rather than two because the weight-absorbed form is then plain multi-query
attention with a single K head of that width whose first kv_lora_rank columns are also V (FlashMLA's 576-wide
layout): one write and one read per layer. Under tensor parallelism the rows are head-independent, so the cache is
replicated while the heads (w_uk, w_uv, the q projection's columns, wo's rows) are split.

Weights (a dict; matrices stored [in, out], the transpose of HF's [out, in] nn.Linear weights):
  wq     [hidden, H * (nope + rope)]          q_proj, when q_lora_rank is null (V2-Lite), with
  wkv_a  [hidden, kv_lora_rank + rope]        kv_a_proj_with_mqa; [c_kv ; k_rope]; otherwise
  wqkv_a [hidden, q_width + kv_lora_rank + rope]  q_a_proj and kv_a_proj_with_mqa side by side (one read of the
                                              layer's input, one launch), q_a's columns zero-padded to q_width
                                              (`fused_q_width`: whole FP8 blocks, so each part keeps its scales)
  q_norm [q_lora_rank]                        q_a_layernorm
  wq_b   [q_lora_rank, H * (nope + rope)]     q_b_proj; per head [q_nope ; q_rope]
  kv_norm [kv_lora_rank]                      kv_a_layernorm (c_kv only)
  w_uk   [H, nope, kv_lora_rank]              kv_b_proj's key rows, per head, as stored ([out, in] of the keys'
                                              up-projection, [in, out] of the absorbed query's: `split_kv_b`)
  w_uv   [H, kv_lora_rank, v]                 kv_b_proj's value rows, per head, [in, out]
  wo     [H * v, hidden]                      o_proj
Head counts and widths are read off these shapes. An FP8 checkpoint adds `<name>_scale` block scales beside
wq / wqkv_a / wq_b / wkv_a / wo (models/fp8.py `linear`); w_uk and w_uv are dequantized when loaded. attention_bias
(biases on q_a/kv_a/o) is not supported: no DeepSeek checkpoint sets it.

Expanded form (`expanded_attention`): the latent rows are up-projected to per-head keys [k_nope ; k_rope] (width
nope + rope) and values (width v), then ordinary attention; what transformers computes, and the form to use where
queries outnumber cached tokens per head (prefill). Absorbed form (`absorbed_attention`): W_UK moves into the query
(q_lat = q_nope W_UK per head), scores are q_lat·c_kv + q_rope·k_rope straight against the cache, the
probabilities average c_kv, and W_UV maps the result to v per head (both per-head products `per_head_matmul`'s);
it reads only the latent rows (decode, verify), through the attention dispatcher (kernels/attention.py: the Pallas
kernel where kernels run). Where wqkv_a and wq_b run as FP8 in the grouped kernel on bf16 rows, the latent rows
kernel (kernels/latent_rows.py, `project_into_cache`) takes wqkv_a's partial products and writes the latent rows
into the cache and q_a's normalised rows for q_b in one launch.
Both use the engine's causal convention (specjax.kernels.attention_reference): query t of row b sits at position
start[b] + t and sees slots <= start[b] + t; slots past the last one this call wrote may hold garbage (NaN) and
are zeroed before use; long query blocks run in chunks of QUERY_CHUNK.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from specjax.kernels.attention import attention
from specjax.kernels.attention_reference import QUERY_CHUNK
from specjax.kernels.grouped_matmul import GroupedMatmulConfig, grouped_matmul
from specjax.kernels.grouped_matmul_triton import takes_f16_rows
from specjax.kernels.latent_rows import latent_rows
from specjax.kernels.policy import KernelPolicy
from specjax.kernels.projection_reference import rms_norm
from specjax.kernels.tree_mask import TreeMask, tree_visible_slots
from specjax.models.fp8 import in_kernel, linear
from specjax.models.rope import unit_rotation
from specjax.parallel.mesh import Layout

# transformers and DeepSeek's reference build q_a_layernorm and kv_a_layernorm with their default eps, not
# config.rms_norm_eps (which only reaches the decoder-layer norms).
LATENT_NORM_EPS = 1e-6

Rotation = Callable[[jax.Array, jax.Array], jax.Array]   # (x [B, T, H, D], positions [B, T]) -> rotated x


def split_kv_b(kv_b_weight, num_heads: int, nope_dim: int, v_dim: int):
    """w_uk [H, nope, R] and w_uv [H, R, v] out of HF's kv_b_proj.weight [H * (nope + v), R], whose rows are
    head-major with [k_nope ; v] per head: each the orientation its absorbed product multiplies by ([in, out]:
    q_nope W_UK and the attended latent W_UV). Works on numpy and JAX arrays alike (loaders call it on host)."""
    rank = kv_b_weight.shape[1]
    per_head = kv_b_weight.reshape(num_heads, nope_dim + v_dim, rank)
    return per_head[:, :nope_dim], per_head[:, nope_dim:].transpose(0, 2, 1)


def fused_q_width(q_lora_rank: int, block: tuple[int, int] | None) -> int:
    """The columns q_a_proj takes in wqkv_a: q_lora_rank, rounded up to whole FP8 blocks ([in, out] `block`)."""
    return q_lora_rank if block is None else -(-q_lora_rank // block[1]) * block[1]


def project_inputs(x: jax.Array, weights: dict, block: tuple[int, int] | None = None,
                   kernels: KernelPolicy = KernelPolicy(), norm: tuple[jax.Array, float] | None = None
                   ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(q_nope [B, T, H, nope], the not yet rotated q_rope [B, T, H, rope], c_kv [B, T, R] normalised by
    kv_a_layernorm, the not yet rotated shared k_rope [B, T, rope]) of hidden states x [B, T, hidden] (normalised
    by `norm` first, fp8.linear): q_proj and kv_a_proj, or q_a_proj and kv_a_proj as one product (wqkv_a) with
    q_a_layernorm -> q_b_proj after."""
    if "wq" in weights:
        q = linear(x, weights, "wq", block, kernels, norm)
        latent = linear(x, weights, "wkv_a", block, kernels, norm)
    else:
        both = linear(x, weights, "wqkv_a", block, kernels, norm)
        q_lora = weights["q_norm"].shape[0]
        latent = both[..., fused_q_width(q_lora, block):]
        q = linear(both, weights, "wq_b", block, kernels, (weights["q_norm"], LATENT_NORM_EPS),
                   leading_columns=True)   # q_a's columns lead wqkv_a's
    rank = weights["kv_norm"].shape[0]
    c_kv = rms_norm(latent[..., :rank], weights["kv_norm"], LATENT_NORM_EPS)
    return *_split_heads(q, x.shape[:-1], weights), c_kv, latent[..., rank:]


def _split_heads(q: jax.Array, leading: tuple[int, ...], weights: dict) -> tuple[jax.Array, jax.Array]:
    """q_b's (or q_proj's) output as (q_nope [..., H, nope], q_rope [..., H, rope]) with `leading` dims."""
    num_heads, nope, _ = weights["w_uk"].shape
    q = q.reshape(*leading, num_heads, -1)
    return q[..., :nope], q[..., nope:]


def latent_rows_in_kernel(x: jax.Array, weights: dict, block: tuple[int, int] | None, kernels: KernelPolicy) -> bool:
    """Whether the layer's latent rows and q's rows come from the latent rows kernel (project_into_cache): bf16
    rows through FP8 wqkv_a and wq_b in the grouped kernel, as scaled float16 rows."""
    tokens = x.shape[0] * x.shape[1]
    return (kernels.latent_rows_kernel and "wqkv_a_scale" in weights and "wq_b_scale" in weights
            and in_kernel(tokens, True, block, kernels) and takes_f16_rows(x.dtype, weights["wq_b"],
                                                                            kernels.fp8_activations))


def project_into_cache(x: jax.Array, weights: dict, block: tuple[int, int], kernels: KernelPolicy,
                       norm: tuple[jax.Array, float] | None, rotate: Rotation, rope_interleaved: bool,
                       positions: jax.Array, cache: jax.Array, layer: jax.Array | int,
                       start: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """project_inputs' q_nope and not yet rotated q_rope, and the cache with the T latent rows written, as
    write_latent writes them: wqkv_a's partial products go to the latent rows kernel, which sums them, writes
    [c_kv ; rotated k_rope] into the cache and hands q_a's normalised rows to q_b as the kernel takes them (one
    launch where XLA's sum, norm, cache write and the rows' own made four)."""
    partials = linear(x, weights, "wqkv_a", block, kernels, norm, split_partials=True)
    rank = weights["kv_norm"].shape[0]
    rotation = unit_rotation(rotate, positions, cache.shape[-1] - rank, rope_interleaved)
    q_rows, cache = latent_rows(partials, (weights["q_norm"], LATENT_NORM_EPS), (weights["kv_norm"], LATENT_NORM_EPS),
                                fused_q_width(weights["q_norm"].shape[0], block), rotation, cache, layer, start,
                                interleaved=rope_interleaved, interpret=kernels.interpret)
    return *_split_heads(linear(q_rows, weights, "wq_b", block, kernels), x.shape[:-1], weights), cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LatentCache:
    """The MLA cache of a wave: one latent row per token per layer, shared by every head."""
    latent: jax.Array   # [L, B, S, kv_lora_rank + qk_rope_head_dim]

    @classmethod
    def init(cls, num_layers: int, batch: int, max_len: int, width: int, dtype) -> LatentCache:
        return cls(jnp.zeros((num_layers, batch, max_len, width), dtype))

    @staticmethod
    def bytes(num_layers: int, batch: int, max_len: int, width: int, dtype) -> int:
        """Bytes of `init`'s cache; every device holds all of it (its rows are head-independent)."""
        return num_layers * batch * max_len * width * jnp.dtype(dtype).itemsize

    def specs(self, layout: Layout) -> LatentCache:
        """Replicated under tensor parallelism: each device attends with its own heads over every row."""
        return LatentCache(P())

    def gathered(self, source: jax.Array, first: jax.Array) -> LatentCache:
        """Slots first[b] + t of every layer hold what slots source[b, t] held (all read before any is
        written)."""
        picked = jnp.take_along_axis(self.latent, source[None, :, :, None], axis=2)     # [L, B, T, W]
        rows = jnp.arange(self.latent.shape[1])[:, None]
        slots = first[:, None] + jnp.arange(source.shape[1])[None, :]
        return LatentCache(self.latent.at[:, rows, slots].set(picked, mode="drop"))


def write_latent(cache: jax.Array, layer: jax.Array | int, rows: jax.Array, start: jax.Array) -> jax.Array:
    """Write rows [B, T, width] into layer `layer` of cache [L, B, S, width] at slots start[b] .. start[b] + T - 1.

    One scatter of B windows [T, width] indexed over the cache's leading dims (layer, row, slot) in order, the
    form XLA updates in place; one row's window a dynamic_update_slice (XLA turns that scatter into one too, but
    behind a read of the old window and a bounds test: two more launches per layer). Slots are clamped so a window
    fits; callers keep start + T <= S."""
    batch = rows.shape[0]
    if batch == 1:
        return lax.dynamic_update_slice(cache, rows[None].astype(cache.dtype), (layer, 0, start[0], 0))
    indices = jnp.stack([jnp.full((batch,), layer, jnp.int32), jnp.arange(batch, dtype=jnp.int32),
                         start.astype(jnp.int32)], axis=-1)
    numbers = lax.ScatterDimensionNumbers(update_window_dims=(1, 2), inserted_window_dims=(0, 1),
                                          scatter_dims_to_operand_dims=(0, 1, 2))
    return lax.scatter(cache, indices, rows.astype(cache.dtype), numbers, indices_are_sorted=True,
                       unique_indices=True, mode=lax.GatherScatterMode.CLIP)


def absorbed_attention(q_nope: jax.Array, q_rope: jax.Array, cache: jax.Array, layer: jax.Array | int,
                       start: jax.Array, w_uk: jax.Array, w_uv: jax.Array, *, scale: float,
                       tree: TreeMask | None = None, kernels: KernelPolicy = KernelPolicy()) -> jax.Array:
    """Per-head outputs [B, T, H, v] of queries (q_nope [B, T, H, nope], rotated q_rope [B, T, H, rope]) against
    the latent cache, with W_UK absorbed into the queries and W_UV applied after the average over c_kv: multi-query
    attention over the cache as one kv head whose first kv_lora_rank columns are the values (the attention
    kernel where `kernels` runs it). A draft tree's pass (`tree`) sees the slots its mask gives."""
    rank = w_uk.shape[2]
    q = jnp.concatenate([per_head_matmul(q_nope, w_uk, kernels), q_rope], axis=-1)   # [B, T, H, R + rope]
    out_latent = attention(q.astype(cache.dtype), cache[:, :, None], None, layer, start, scale=scale,
                           value_dim=rank, kernels=kernels, tree=tree)
    return per_head_matmul(out_latent.astype(q_nope.dtype), w_uv, kernels)


def per_head_matmul(x: jax.Array, w: jax.Array, kernels: KernelPolicy) -> jax.Array:
    """x [B, T, H, K] times each head's own matrix of w [H, K, N]: [B, T, H, N]. Where the policy runs kernels at
    this few tokens, the grouped matmul kernel over x's rows as they lie (interleaved: a row per head, no
    transposes), each head's matrix read once per 16 tokens; XLA's batched product elsewhere."""
    batch, tokens, heads, width = x.shape
    if not kernels.use_head_matmul_kernel(batch * tokens):
        return jnp.einsum("bthk,hkn->bthn", x, w)
    out = grouped_matmul(x.reshape(-1, width), w, interleaved=True, kernels=kernels, config=head_config(w))
    return out.reshape(batch, tokens, heads, -1)


def head_config(w: jax.Array) -> GroupedMatmulConfig:
    """The grouped kernel's launch parameters for per-head matrices w [H, K, N] (a few rows each): column blocks
    as wide as N allows up to 256 and K whole in each program, where the bf16 stacks' default (32 columns, for
    experts) cuts V3's 128 heads into thousands of 8 KB programs (sweep in benchmarks/RESULTS.md, "The router's
    and MLA's products: launch parameters")."""
    return GroupedMatmulConfig(block_n=min(256, w.shape[2]), k_splits=1)


def expanded_attention(q_nope: jax.Array, q_rope: jax.Array, cache: jax.Array, layer: jax.Array | int,
                       start: jax.Array, w_uk: jax.Array, w_uv: jax.Array, *, scale: float,
                       tree: TreeMask | None = None) -> jax.Array:
    """`absorbed_attention`'s result computed the naive way: every cached row up-projected to per-head k_nope
    and v, then attention with key width nope + rope (the shared k_rope joins every head) and value width v."""
    def attend(queries, latent, first_position):
        nope, rope = queries
        rank = w_uk.shape[2]
        k_nope = jnp.einsum("bsr,hnr->bshn", latent[..., :rank], w_uk)
        values = jnp.einsum("bsr,hrv->bshv", latent[..., :rank], w_uv)
        logits = (jnp.einsum("bthn,bshn->bhts", nope, k_nope, preferred_element_type=jnp.float32)
                  + jnp.einsum("bthp,bsp->bhts", rope, latent[..., rank:], preferred_element_type=jnp.float32))
        probs = _masked_softmax(logits * scale, first_position, tree)
        return jnp.einsum("bhts,bshv->bthv", probs, values.astype(jnp.float32)).astype(nope.dtype)

    return _latent_attention(attend, q_nope, q_rope, cache, layer, start)


def _latent_attention(attend, q_nope: jax.Array, q_rope: jax.Array, cache: jax.Array, layer: jax.Array | int,
                      start: jax.Array) -> jax.Array:
    """attend((q_nope, q_rope), latent [B, S, W], first_position [B]) on layer `layer` of the cache, with the
    slots this call did not reach zeroed (a zero probability times NaN garbage would poison the sums), over
    query chunks of QUERY_CHUNK tokens when there are more (bounds the [B, H, T, S] logits)."""
    latent = lax.dynamic_index_in_dim(cache, layer, axis=0, keepdims=False)
    num_tokens = q_nope.shape[1]
    start = start.astype(jnp.int32)
    written = jnp.arange(latent.shape[1], dtype=jnp.int32)[None, :] < (start + num_tokens)[:, None]
    latent = jnp.where(written[..., None], latent, jnp.zeros((), latent.dtype))
    if num_tokens <= QUERY_CHUNK:
        return attend((q_nope, q_rope), latent, start)
    return _in_query_chunks(attend, (q_nope, q_rope), latent, start)


def _in_query_chunks(attend, queries: tuple[jax.Array, ...], latent: jax.Array, start: jax.Array) -> jax.Array:
    """attend over consecutive chunks of QUERY_CHUNK query tokens (each query array is [B, T, ...])."""
    num_tokens = queries[0].shape[1]
    num_chunks = -(-num_tokens // QUERY_CHUNK)

    def chunked(q):
        padded = jnp.pad(q, [(0, 0), (0, num_chunks * QUERY_CHUNK - num_tokens)] + [(0, 0)] * (q.ndim - 2))
        return padded.reshape(q.shape[0], num_chunks, QUERY_CHUNK, *q.shape[2:]).swapaxes(0, 1)

    offsets = jnp.arange(num_chunks, dtype=jnp.int32) * QUERY_CHUNK
    out = lax.map(lambda chunk: attend(chunk[0], latent, start + chunk[1]),
                  (tuple(chunked(q) for q in queries), offsets))
    batch, per_token = out.shape[1], out.shape[3:]   # out: [chunks, B, QUERY_CHUNK, ...]
    return out.swapaxes(0, 1).reshape(batch, num_chunks * QUERY_CHUNK, *per_token)[:, :num_tokens]


def _masked_softmax(logits: jax.Array, first_position: jax.Array, tree: TreeMask | None) -> jax.Array:
    """Softmax in fp32 of logits [B, H, T, S] over the slots each query may see: slot <= first_position[b] + t,
    or a draft tree's mask (a tree pass is one query chunk)."""
    num_tokens, num_slots = logits.shape[2:]
    if tree is None:
        positions = first_position[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
        visible = jnp.arange(num_slots, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]
    else:
        visible = tree_visible_slots(tree, num_slots, jnp.int32(0))
    return jax.nn.softmax(jnp.where(visible[:, None], logits.astype(jnp.float32), -jnp.inf), axis=-1)


def mla_attention(x: jax.Array, weights: dict, cache: jax.Array, layer: jax.Array | int, start: jax.Array, *,
                  rotate: Rotation, rope_interleaved: bool, scale: float, absorbed: bool,
                  block: tuple[int, int] | None = None,
                  tree: TreeMask | None = None, kernels: KernelPolicy = KernelPolicy(),
                  norm: tuple[jax.Array, float] | None = None) -> tuple[jax.Array, jax.Array]:
    """One MLA layer on hidden states x [B, T, hidden] at positions start[b] + t (normalised by `norm`, the
    layer's input RMSNorm, inside the projections: fp8.linear): its T latent rows written into the cache, then
    attention in the absorbed or expanded form, then o_proj. Returns (out [B, T, hidden], cache).

    `rotate` applies the rope (e.g. functools.partial(rope.apply_rope, inv_freq=..., interleaved=True,
    attention_factor=...)) to q's rope part and to the one shared k_rope head, its pairs interleaved or not as
    `rope_interleaved` says; `scale` is the softmax scale
    (rope.yarn_softmax_scale); `block` the FP8 weights' block shape ([in, out] orientation); `tree` a draft
    tree's pass (its tokens at tree.positions, written at slots start[b] + t); `kernels` how FP8 projections
    (fp8.linear) and the absorbed form's attention run."""
    batch, num_tokens = x.shape[:2]
    positions = (start.astype(jnp.int32)[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :] if tree is None
                 else tree.positions)
    if latent_rows_in_kernel(x, weights, block, kernels):
        q_nope, q_rope, cache = project_into_cache(x, weights, block, kernels, norm, rotate, rope_interleaved,
                                                   positions, cache, layer, start)
    else:
        q_nope, q_rope, c_kv, k_rope = project_inputs(x, weights, block, kernels, norm)
        k_rope = rotate(k_rope[:, :, None, :], positions)[:, :, 0, :]
        cache = write_latent(cache, layer, jnp.concatenate([c_kv, k_rope], axis=-1), start)
    q_rope = rotate(q_rope, positions)
    attend = functools.partial(absorbed_attention, kernels=kernels) if absorbed else expanded_attention
    heads = attend(q_nope, q_rope, cache, layer, start, weights["w_uk"], weights["w_uv"], scale=scale, tree=tree)
    return linear(heads.reshape(batch, num_tokens, -1), weights, "wo", block, kernels), cache
