"""Draft head training with optax (an EAGLE-3 head, or an MTP layer): token-level loss against the target's
distribution, with training-time test (TTT) steps that feed the head its own outputs, as at inference.

Head index t reads the token at t+1 with the target's features at t. TTT step j stands for drafting step j:
index t is then position t+j and reads the token at t+j+1 with the head's own hidden state from step j-1;
it predicts the token at t+j+2, against the target's distribution at t+j+1 restricted to the draft vocabulary.
Its attention sees what inference's KV cache would hold: step 0's keys (target features) at positions <= t
and its own keys from steps 1..j at index t (the diagonal). Positions whose target token (the target's own
argmax: the responses are its greedy output) falls outside the draft vocabulary, or that are not response
tokens, are left out of the loss, as in EAGLE-3. Step j's loss is weighted by step_decay**j. An MTP layer is
trained the same way: its step 0 reads the target's final hidden state (EAGLE-3: the captured layers), later
steps its own output, which is what MTP drafting recycles.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from specjax.models.eagle import EagleConfig, EagleHead
from specjax.models.family import Frozen
from specjax.kernels.policy import KernelPolicy
from specjax.models.llama import LlamaConfig
from specjax.models.mtp import MtpConfig, MtpHead
from specjax.training.features import FeatureStore


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    total_steps: int
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    ttt_steps: int = 3
    step_decay: float = 0.8


@dataclasses.dataclass
class Batch:
    tokens: np.ndarray      # i32 [B, T]
    aux: np.ndarray         # f16 [B, T, n*H] the target's captured layers (as stored; cast on the device)
    final: np.ndarray       # f16 [B, T, H] the target's final-normed hidden states
    response: np.ndarray    # bool [B, T] response tokens (padding and prompt are False)


def new_head(target_cfg: LlamaConfig, target_state: Any, draft_ids: np.ndarray, aux_layer_ids: tuple[int, ...],
             *, seed: int = 0, kernels: KernelPolicy = KernelPolicy(impl="reference")) -> EagleHead:
    """A fresh EAGLE-3 head for the target: one decoder layer shaped like the target's, the target's
    embedding (frozen), a final norm and lm_head started from the target's (its draft-vocabulary rows).
    kernels: the pure-JAX maths by default, as training needs; a head that only drafts (a benchmark's) takes
    the engine's policy, as a loaded head does."""
    layers = dataclasses.replace(target_cfg, num_layers=1, architecture="LlamaForCausalLMEagle3",
                                 tie_word_embeddings=False, qk_norm=False)
    cfg = EagleConfig(method="eagle3", layers=layers, target_hidden_size=target_cfg.hidden_size,
                      draft_vocab_size=len(draft_ids), aux_layer_ids=tuple(aux_layer_ids))
    dtype = target_state["embed"][...].dtype
    # Trained under jax.grad: the pure-JAX maths (the Pallas kernels have no derivatives).
    head = EagleHead(cfg, dtype=dtype, rngs=nnx.Rngs(seed), kernels=kernels)
    head.embed = Frozen(target_state["embed"][...])
    # Output norm and lm_head start as the target's own: a head that reproduced the target's final hidden
    # state would then reproduce its logits.
    head.norm[...] = target_state["final_norm"][...]
    head.lm_head[...] = target_unembedding(target_cfg, target_state)[:, draft_ids]
    if cfg.reduced_vocab:
        head.draft_to_target[...] = jnp.asarray(draft_ids, jnp.int32)
    return head


def new_mtp_head(target_cfg: LlamaConfig, target_state: Any, *, seed: int = 0) -> MtpHead:
    """A fresh MTP layer for a Llama-family target in MiMo's layout: a decoder block shaped like the target's,
    the target's embedding and lm_head (frozen, shared at inference), the output norm started from the target's."""
    cfg = MtpConfig(target=target_cfg, num_mtp_layers=1, layout="mimo", hidden_first=True)
    head = MtpHead(cfg, dtype=target_state["embed"][...].dtype, rngs=nnx.Rngs(seed),
                   kernels=KernelPolicy(impl="reference"))
    head.embed = Frozen(target_state["embed"][...])
    head.lm_head = Frozen(target_state["embed"][...] if target_cfg.tie_word_embeddings
                          else target_state["lm_head"][...])
    head.shared_norm[...] = target_state["final_norm"][...]
    return head


DraftHead = EagleHead | MtpHead


def target_unembedding(target_cfg: LlamaConfig, target_state: Any) -> jax.Array:
    """The target's lm_head as [H, V] (the embedding transposed when tied)."""
    if target_cfg.tie_word_embeddings:
        return target_state["embed"][...].T
    return target_state["lm_head"][...]


class Trainer:
    """Holds the head's graph, its trainable params, the optimizer state and one jitted step per shape."""

    def __init__(self, head: DraftHead, target_cfg: LlamaConfig, target_state: Any, config: TrainConfig):
        self.config = config
        self.graph, self.params, self.frozen = nnx.split(head, nnx.Param, ...)
        ids = head.draft_to_target[...] if head.cfg.reduced_vocab else jnp.arange(head.cfg.draft_vocab_size)
        self.teacher = target_unembedding(target_cfg, target_state)[:, ids]   # [H, Vd]
        in_draft = np.zeros(target_cfg.vocab_size, bool)
        in_draft[np.asarray(ids)] = True
        self.in_draft = jnp.asarray(in_draft)
        schedule = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, config.warmup_steps,
                                                      max(config.total_steps, config.warmup_steps + 1),
                                                      config.learning_rate * 0.05)
        self.optimizer = optax.chain(optax.clip_by_global_norm(config.grad_clip),
                                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=config.weight_decay))
        self.opt_state = self.optimizer.init(self.params)
        self._step = jax.jit(self._train_step)

    def head(self) -> DraftHead:
        return nnx.merge(self.graph, self.params, self.frozen)

    def step(self, batch: Batch) -> dict[str, float]:
        self.params, self.opt_state, metrics = self._step(self.params, self.opt_state, self.frozen, self.teacher,
                                                          self.in_draft, jax.tree.map(jnp.asarray, vars(batch)))
        return {name: float(value) for name, value in metrics.items()}

    def _train_step(self, params, opt_state, frozen, teacher, in_draft, batch):
        def loss_fn(p):
            head = nnx.merge(self.graph, p, frozen)
            return ttt_loss(head, teacher, in_draft, batch, self.config.ttt_steps, self.config.step_decay)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, dict(metrics, loss=loss)


def ttt_loss(head: DraftHead, teacher: jax.Array, in_draft: jax.Array, batch: dict, ttt_steps: int,
             step_decay: float) -> tuple[jax.Array, dict]:
    """The weighted TTT loss and per-step accuracy (head argmax == target argmax where counted)."""
    tokens, response = batch["tokens"], batch["response"]
    target_logp = jax.nn.log_softmax(jnp.dot(batch["final"].astype(teacher.dtype), teacher,
                                             preferred_element_type=jnp.float32), axis=-1)   # [B, T, Vd]
    features = batch["aux"] if head.capture_layers else batch["final"]   # EAGLE-3's layers; MTP's final state
    outputs = ttt_forward(head, tokens, features.astype(teacher.dtype), ttt_steps)
    total, weights, metrics = 0.0, 0.0, {}
    for j, out in enumerate(outputs):
        logp = jax.nn.log_softmax(head.logits(out), axis=-1)
        p = jnp.exp(_shift_left(target_logp, j + 1))
        predicted = _shift_left(tokens, j + 2)
        counted = _shift_left(response, j + 2) & in_draft[predicted]
        n = jnp.maximum(jnp.sum(counted), 1)
        loss_j = -jnp.sum(jnp.where(counted, jnp.sum(p * logp, axis=-1), 0.0)) / n
        hits = (jnp.argmax(logp, -1) == jnp.argmax(p, -1)) & counted
        total, weights = total + step_decay ** j * loss_j, weights + step_decay ** j
        metrics[f"acc_{j}"] = jnp.sum(hits) / n
        metrics[f"loss_{j}"] = loss_j
    return total / weights, metrics


def ttt_forward(head: DraftHead, tokens: jax.Array, features: jax.Array, ttt_steps: int) -> list[jax.Array]:
    """The head's outputs [B, T, H] at each TTT step: step j at index t reads the token at t+j+1, the target's
    features (j = 0) or its own step j-1 hidden state, at position t+j."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T)[None], (B, T))
    hidden = head.combine(features)
    keys: dict[int, list] = {}
    outputs = []
    for j in range(ttt_steps):
        out, hidden = head.decode(_shift_left(tokens, j + 1), hidden, positions + j,
                                  _ttt_attention(keys, j, head.cfg.layers.head_dim))
        outputs.append(out)
    return outputs


def _shift_left(x: jax.Array, n: int) -> jax.Array:
    """x[:, t + n] at t (zeros / False past the end)."""
    pad = jnp.zeros((x.shape[0], n) + x.shape[2:], x.dtype)
    return jnp.concatenate([x[:, n:], pad], axis=1)


def _ttt_attention(keys: dict[int, list], step: int, head_dim: int):
    """Attention for TTT step `step`: query t sees step 0's keys at indices <= t and each later step's key
    at index t. `keys` collects every step's (k, v) per layer across the steps of one loss evaluation."""
    scale = head_dim ** -0.5

    def attend(layer: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        if step == 0:
            keys[layer] = []
        keys[layer].append((k, v))
        (k0, v0), diagonal = keys[layer][0], keys[layer][1:]
        B, T, Hq, D = q.shape
        Hkv = k.shape[2]
        qg = q.reshape(B, T, Hkv, Hq // Hkv, D).astype(jnp.float32)
        causal = jnp.einsum("bthgd,bshd->bhgts", qg, k0.astype(jnp.float32)) * scale
        causal = jnp.where(jnp.tril(jnp.ones((T, T), bool)), causal, -jnp.inf)
        own = [jnp.einsum("bthgd,bthd->bhgt", qg, kd.astype(jnp.float32))[..., None] * scale for kd, _ in diagonal]
        probs = jax.nn.softmax(jnp.concatenate([causal] + own, axis=-1), axis=-1)
        out = jnp.einsum("bhgts,bshd->bthgd", probs[..., :T], v0.astype(jnp.float32))
        for i, (_, vd) in enumerate(diagonal):
            out = out + jnp.einsum("bhgt,bthd->bthgd", probs[..., T + i], vd.astype(jnp.float32))
        return out.reshape(B, T, Hq, D).astype(q.dtype)

    return attend


def batches(store: FeatureStore, examples: np.ndarray, tokens_per_batch: int,
            rng: np.random.Generator) -> Iterator[Batch]:
    """One pass over `examples` (indices into the store) in random order, grouped by similar length. A batch
    is [tokens_per_batch // T, T] with T the group's length rounded up to LENGTH_BUCKET (short groups padded
    with empty rows), so training compiles one step per length bucket, not one per batch shape."""
    order = rng.permutation(examples)
    groups = []
    for begin in range(0, len(order), 256):   # sort within windows: random, yet similar lengths together
        window = sorted(order[begin:begin + 256], key=store.length)
        current: list[int] = []
        for n in window:
            if current and (len(current) + 1) * bucket_length(store.length(n)) > tokens_per_batch:
                groups.append(current)
                current = []
            current.append(n)
        if current:
            groups.append(current)
    for i in rng.permutation(len(groups)):
        T = bucket_length(store.length(groups[i][-1]))   # the longest of its sorted group
        yield make_batch(store, groups[i], rows=tokens_per_batch // T)


LENGTH_BUCKET = 128


def bucket_length(length: int) -> int:
    """Sequence lengths rounded up to LENGTH_BUCKET: a handful of shapes, so few compilations."""
    return -(-length // LENGTH_BUCKET) * LENGTH_BUCKET


def make_batch(store: FeatureStore, indices: list[int], rows: int | None = None) -> Batch:
    """The conversations `indices` padded to a common bucketed length, plus empty rows up to `rows`."""
    T = bucket_length(max(store.length(n) for n in indices))
    B = max(rows or 0, len(indices))
    tokens = np.zeros((B, T), np.int32)
    aux = np.zeros((B, T, store.aux.shape[1]), store.aux.dtype)
    final = np.zeros((B, T, store.final.shape[1]), store.final.dtype)
    response = np.zeros((B, T), bool)
    for row, n in enumerate(indices):
        begin, end = int(store.offsets[n]), int(store.offsets[n + 1])
        length = end - begin
        tokens[row, :length] = store.tokens[begin:end]
        aux[row, :length] = store.aux[begin:end]
        final[row, :length] = store.final[begin:end]
        response[row, int(store.prompt_lengths[n]):length] = True
    return Batch(tokens, aux, final, response)
