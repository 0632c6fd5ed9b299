"""The target's own greedy responses and its hidden states, recorded in one go by the real engine loop.

`FeatureRecorder` is a proposer that drafts nothing (k = 0, plain decoding) and asks the loop for the
residual streams EAGLE-3 reads (none for an MTP layer, which reads the final states): its `observe` writes
each pass's captured layers and final hidden states into time-major buffers in its carry (the prefill covers the prompt, each decode step the last committed
token), and the host puts each row's positions back in order. So training data costs one generation,
with no second pass over the conversations.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from specjax.engine.loop import LoopSpec, jit_generate
from specjax.engine.proposers.base import TargetPass
from specjax.engine.rows import greedy_rows
from specjax.engine.shapes import MIN_PROMPT_BUCKET, bucket, buffer_len
from specjax.models.llama import FAMILY, stack_layers
from specjax.training.features import FeatureWriter


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Recording:
    """Time-major buffers: every pass writes all rows at one common index. The prefill (prompts padded to
    width P) fills indices 0..P-1 with positions 0..P-1; decode step j (one token per row, at the row's own
    position prompt_length + j) writes index P + j."""
    aux: jax.Array     # f16 [S, B, n*H]
    final: jax.Array   # f16 [S, B, H]
    next: jax.Array    # i32 [] the index the next pass writes at


class FeatureRecorder:
    k = 0
    tree = None   # plain decoding: no draft tree

    def __init__(self, aux_layer_ids: Sequence[int], hidden_size: int):
        self.capture_layers = tuple(aux_layer_ids)
        self.hidden_size = hidden_size

    def init(self, draft_state, prompt_tokens: jax.Array, prompt_lengths: jax.Array, cache_len: int) -> Recording:
        (B, P), H = prompt_tokens.shape, self.hidden_size
        S = P + cache_len   # the prefill's P indices plus at most one per decode step
        return Recording(jnp.zeros((S, B, len(self.capture_layers) * H), jnp.float16),
                         jnp.zeros((S, B, H), jnp.float16), jnp.zeros((), jnp.int32))

    def propose(self, draft_state, carry, tokens, lengths, rows):
        return jnp.zeros((tokens.shape[0], 0), jnp.int32), None, carry

    def observe(self, draft_state, carry: Recording, target: TargetPass, tokens, lengths, rows) -> Recording:
        # One in-place update per buffer: rows at their own positions would need a scatter (or one update per
        # row), and XLA copies the whole buffer for a scatter in the loop, every step.
        captured = (jnp.zeros(target.hidden.shape[:2] + (0,)) if target.captured is None   # MTP: no layers
                    else jnp.clip(target.captured, -65504.0, 65504.0)).astype(jnp.float16)
        return Recording(_write_at(carry.aux, captured, carry.next),
                         _write_at(carry.final, target.hidden.astype(jnp.float16), carry.next),
                         carry.next + target.hidden.shape[1])

    @staticmethod
    def row_features(buffer: np.ndarray, row: int, prompt_width: int, prompt_length: int, length: int) -> np.ndarray:
        """Row `row`'s features at positions 0 .. length-1 from a fetched time-major buffer; the last committed
        token was never run through the target, so its row is zeros."""
        generated = buffer[prompt_width:prompt_width + length - 1 - prompt_length, row]
        return np.concatenate([buffer[:prompt_length, row], generated, np.zeros_like(buffer[:1, row])])


def _write_at(buffer: jax.Array, values: jax.Array, index: jax.Array) -> jax.Array:
    """values [B, T, F] into buffer [S, B, F] at indices index .. index+T-1."""
    return jax.lax.dynamic_update_slice(buffer, jnp.swapaxes(values, 0, 1), (index, 0, 0))


def record(llm: Any, prompt_ids: Sequence[list[int]], max_new_tokens: int, aux_layer_ids: Sequence[int],
           writer: FeatureWriter, batch: int = 32) -> None:
    """Greedy responses to prompt_ids[writer.num_examples:] (earlier ones were recorded by a previous run),
    appended with their hidden states to `writer`, flushed after each wave."""
    recorder = FeatureRecorder(aux_layer_ids, llm.model_config.hidden_size)
    spec = LoopSpec(k=0, n_top=0, max_model_len=llm.max_model_len)
    graph, params = _scanned(llm)
    generate = jit_generate(graph, recorder, spec)
    with tqdm(total=len(prompt_ids), initial=writer.num_examples, desc="target responses + hidden states") as bar:
        for begin in range(writer.num_examples, len(prompt_ids), batch):
            wave = prompt_ids[begin:begin + batch]
            prompts, lengths, cache_len = _pack(wave, batch, max_new_tokens, llm.max_model_len)
            budgets = [max_new_tokens] * len(wave) + [0] * (batch - len(wave))   # padding rows generate nothing
            state = generate(params, None, prompts, lengths, greedy_rows(batch, budgets, llm.eos_token_ids),
                             cache_len)
            # Only what is written out comes to the host (not the KV cache: gigabytes at recording batches).
            tokens, ends, recording = jax.device_get((state.tokens, state.lengths, state.proposer))
            width = prompts.shape[1]
            for row, prompt in enumerate(wave):
                end = int(ends[row])
                aux, final = (recorder.row_features(buffer, row, width, len(prompt), end)
                              for buffer in (recording.aux, recording.final))
                writer.append(tokens[row, :end], len(prompt), aux, final)
            writer.flush()
            bar.update(len(wave))


def _scanned(llm: Any) -> tuple[nnx.GraphDef, Any]:
    """The target with its layers stacked and scanned (graph, params). Recording runs large batches, and
    unrolled layers put batch x layers KV-cache row writes into the compiled loop (at batch 256 an H200 run
    finished no wave in minutes, most likely still compiling); scanned, the loop body holds one layer's
    writes, and the weight-slice copies scanning costs are small next to a batch-256 step. Unrolled weights
    are stacked into a copy for this."""
    model = nnx.merge(llm.target_graph, llm.params)
    if not model.unroll_layers:
        return llm.target_graph, llm.params
    scanned = FAMILY.build(llm.model_config, stack_layers(nnx.to_pure_dict(llm.params)), kernels=model.kernels,
                           unroll_layers=False)
    return nnx.split(scanned)


def _pack(wave: Sequence[list[int]], batch: int, max_new_tokens: int, max_model_len: int):
    longest = max(len(p) for p in wave)
    P = bucket(longest, MIN_PROMPT_BUCKET)
    prompts = np.zeros((batch, P), np.int32)
    lengths = np.ones((batch,), np.int32)
    for row, p in enumerate(wave):
        prompts[row, :len(p)] = p
        lengths[row] = len(p)
    cache_len = buffer_len(P, longest, max_new_tokens, 0, max_model_len)
    return jnp.asarray(prompts), jnp.asarray(lengths), cache_len
