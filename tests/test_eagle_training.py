"""EAGLE-3 training: the recorded features are the target's, training-time test attends as inference does,
the published layout round-trips, the data helpers, and the entry point end to end on a tiny configuration."""
from __future__ import annotations

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file
from training_checks import assert_ttt_drafts_as_inference

from benchmarks.bench_eagle import GSM8K
from checkpoints_conv.eagle_loader import load_eagle_head
from checkpoints_conv.eagle_writer import save_eagle3_head
from specjax.models.llama import FAMILY, LlamaConfig
from specjax.training import data as data_lib
from specjax.training.__main__ import main
from specjax.training.features import FeatureStore, FeatureWriter, open_features
from specjax.training.record import record
from specjax.training.trainer import (LENGTH_BUCKET, TrainConfig, Trainer, batches, make_batch, new_head,
                                      ttt_forward)

TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=61, hidden_size=32, intermediate_size=48,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
            rope_theta=1e4, tie_word_embeddings=True, max_position_embeddings=256, eos_token_id=2)
TINY_CFG = LlamaConfig.from_hf_dict(TINY)
AUX = (0, 2, 3)


@pytest.fixture(scope="module")
def tiny_target():
    graph, state = nnx.split(FAMILY.random(TINY_CFG, seed=0))
    return graph, jax.tree.map(lambda x: x * 3, state)


@pytest.fixture(scope="module")
def recorded(tiny_target, tmp_path_factory):
    """Three prompts of different lengths answered greedily (16 new tokens) by the tiny target, recorded."""
    llm = types.SimpleNamespace(model_config=TINY_CFG, max_model_len=64, target_graph=tiny_target[0],
                                params=tiny_target[1], eos_token_ids=[2])
    prompts = [[5, 9, 11, 7, 30], [40, 3], [8, 8, 21, 17, 33, 50, 12, 6, 44]]
    path = tmp_path_factory.mktemp("features")
    writer = FeatureWriter(path, 200, TINY_CFG.hidden_size, AUX)
    record(llm, prompts[:2], 16, AUX, writer, batch=2)
    writer = FeatureWriter(path, 200, TINY_CFG.hidden_size, AUX)   # a second run resumes after the first two
    record(llm, prompts, 16, AUX, writer, batch=2)
    return open_features(path), prompts


def test_recorded_features_are_a_teacher_forced_target_pass(tiny_target, recorded):
    store, prompts = recorded
    assert store.num_examples == 3 and store.prompt_lengths.tolist() == [len(p) for p in prompts]
    target = nnx.merge(*tiny_target)
    for n, prompt in enumerate(prompts):
        tokens = store.tokens[store.offsets[n]:store.offsets[n + 1]]
        assert tokens[:len(prompt)].tolist() == prompt and len(tokens) > len(prompt)
        seq = jnp.asarray(tokens[None])
        hidden, _, aux = target(seq, jnp.zeros((1,), jnp.int32), target.init_cache(1, len(tokens)),
                                capture_layers=AUX)
        # Every position but the last token (never run through the target while generating) is recorded.
        span = slice(store.offsets[n], store.offsets[n + 1] - 1)
        np.testing.assert_allclose(store.aux[span], aux.captured[0, :-1], rtol=2e-3, atol=2e-3)
        np.testing.assert_allclose(store.final[span], hidden[0, :-1], rtol=2e-3, atol=2e-3)
        # The response is the target's greedy continuation.
        logits = target.logits(hidden[0, len(prompt) - 1:-1])
        assert np.array_equal(np.argmax(logits, -1), tokens[len(prompt):])


def test_an_unrolled_target_records_what_the_scanned_one_does(tiny_target, recorded, tmp_path):
    """The GPU layout (per-layer weights, unrolled) is stacked into a scanned copy for recording: the same
    responses and features as recording the scanned target."""
    store, prompts = recorded
    stacked = nnx.to_pure_dict(jax.tree.map(jnp.copy, tiny_target[1]))
    graph, params = nnx.split(FAMILY.build(TINY_CFG, stacked, unroll_layers=True))
    llm = types.SimpleNamespace(model_config=TINY_CFG, max_model_len=64, target_graph=graph, params=params,
                                eos_token_ids=[2])
    writer = FeatureWriter(tmp_path, 200, TINY_CFG.hidden_size, AUX)
    record(llm, prompts, 16, AUX, writer, batch=2)
    unrolled = open_features(tmp_path)
    np.testing.assert_array_equal(unrolled.tokens, store.tokens)
    np.testing.assert_allclose(unrolled.aux, store.aux, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(unrolled.final, store.final, rtol=1e-3, atol=1e-3)


def test_training_time_test_attends_as_inference_drafts(tiny_target, recorded):
    """TTT step j at index t must compute what drafting step j computes after the committed tokens up to t+1,
    with the KV cache holding target-feature keys up to t and the head's own keys after."""
    store, _ = recorded
    head = new_head(TINY_CFG, tiny_target[1], np.arange(40, dtype=np.int32), AUX, seed=3)
    batch = make_batch(store, [0])
    assert_ttt_drafts_as_inference(head, jnp.asarray(batch.tokens), jnp.asarray(batch.aux), 3)


def test_training_lowers_the_loss_and_round_trips_through_the_published_layout(tiny_target, recorded, tmp_path):
    store, _ = recorded
    draft_ids = data_lib.draft_vocabulary(store.response_tokens(), store.tokens, 61, 40)
    head = new_head(TINY_CFG, tiny_target[1], draft_ids, AUX)
    trainer = Trainer(head, TINY_CFG, tiny_target[1], TrainConfig(total_steps=30, learning_rate=3e-3,
                                                                   warmup_steps=1))
    batch = make_batch(store, [0, 1, 2])
    metrics = [trainer.step(batch) for _ in range(30)]
    # The loss is a cross-entropy against the target's soft distribution: it falls towards that entropy.
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.3
    assert metrics[-1]["acc_0"] > metrics[0]["acc_0"]
    trained = trainer.head()
    out = save_eagle3_head(trained, tmp_path / "EAGLE3-tiny", TINY, dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 40
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    loaded = load_eagle_head(out, "eagle3", TINY_CFG, tiny_target[1], np.float32)
    x = jax.random.normal(jax.random.key(0), (2, 5, 32))
    np.testing.assert_allclose(loaded.target_logits(x), trained.target_logits(x), rtol=1e-5)
    tokens = jnp.asarray(batch.tokens)
    np.testing.assert_allclose(ttt_forward(loaded, tokens, jnp.asarray(batch.aux), 2)[1],
                               ttt_forward(trained, tokens, jnp.asarray(batch.aux), 2)[1], rtol=1e-4, atol=1e-5)


def test_batches_cover_every_conversation_once_in_one_shape_per_length_bucket():
    """Training compiles one step per batch shape: every batch is [tokens_per_batch // T, T] for its
    length bucket T, its padding rows count for nothing, and one pass yields each conversation once."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 700, size=300)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    total = int(offsets[-1])
    store = FeatureStore(tokens=np.arange(total, dtype=np.int32), offsets=offsets,
                         prompt_lengths=np.minimum(lengths - 1, 5).astype(np.int32),
                         aux=np.zeros((total, 6), np.float16), final=np.zeros((total, 2), np.float16),
                         aux_layer_ids=(0, 1, 2))
    seen, shapes = [], set()
    for batch in batches(store, np.arange(300), 2048, rng):
        B, T = batch.tokens.shape
        assert T % LENGTH_BUCKET == 0 and B == max(2048 // T, 1), (B, T)
        shapes.add((B, T))
        assert batch.aux.dtype == np.float16   # cast on the device, not on the host
        for row in range(B):
            if batch.response[row].any():
                first = int(batch.tokens[row, 0])
                n = int(np.searchsorted(offsets, first))
                assert offsets[n] == first and batch.tokens[row, :lengths[n]].tolist() == list(
                    range(first, first + lengths[n]))
                seen.append(n)
            else:
                assert not batch.tokens[row].any()   # a padding row
    assert sorted(seen) == list(range(300))
    assert len(shapes) <= -(-700 // LENGTH_BUCKET)


def test_draft_vocabulary_takes_the_most_frequent_response_tokens():
    responses = np.asarray([7, 7, 7, 3, 3, 9, 1, 1])
    everything = np.concatenate([responses, [5, 5, 5, 5, 9]])
    assert data_lib.draft_vocabulary(responses, everything, 12, 3).tolist() == [1, 3, 7]
    # 3 and 1 tie in the responses (broken by id above); 9 (one response) comes before 5 (prompts only).
    assert data_lib.draft_vocabulary(responses, everything, 12, 4).tolist() == [1, 3, 7, 9]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        data_lib.draft_vocabulary(responses, everything, 12, 13)


def test_held_out_questions_never_reach_training(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": "a"}) + "\n" for i in range(50)))
    questions = data_lib.load_questions(path)
    train, held = data_lib.split_heldout(questions, 10, seed=1)
    assert len(held) == 10 and len(train) == 40 and not set(train) & set(held)
    assert (train, held) == data_lib.split_heldout(questions, 10, seed=1)
    with pytest.raises(ValueError, match="num_heldout"):
        data_lib.split_heldout(questions, 50)


def test_training_entry_point_runs_end_to_end(tiny_chat_model, tmp_path):
    """python -m specjax.training on a tiny configuration (a 4-layer random target with the default model's
    tokenizer): record, train, save, evaluate with the real loop."""
    out, work = tmp_path / "EAGLE3-head", tmp_path / "work"
    assert main(["--target", str(tiny_chat_model), "--prompts", str(GSM8K),
                 "--out", str(out), "--work", str(work), "--num-train", "6", "--num-heldout", "3",
                 "--num-eval", "2", "--max-new-tokens", "12", "--max-model-len", "256", "--generate-batch", "4",
                 "--draft-vocab-size", "512", "--steps", "3", "--log-every", "1",
                 "--tokens-per-batch", "1024"]) == 0
    log = [json.loads(line) for line in (work / "log.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in log] == ["data", "train", "train", "train", "eval"]
    assert log[0]["examples"] == 6 and all(np.isfinite(r["loss"]) for r in log[1:4])
    assert log[-1]["num_drafts"] > 0 and 1.0 <= log[-1]["acceptance_length"] <= 4.0
    summary = json.loads((out / "training.json").read_text())
    assert summary["evaluation"] == {k: v for k, v in log[-1].items() if k not in ("stage", "step")}
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 512
    # Continuing from the saved head: with a zero learning rate the head saved after a step is the one it
    # started from (draft vocabulary included), and the recording is reused, not repeated.
    again = tmp_path / "EAGLE3-continued"
    common = ["--target", str(tiny_chat_model), "--prompts", str(GSM8K),
              "--work", str(work), "--num-train", "6", "--num-heldout", "3", "--num-eval", "1",
              "--max-new-tokens", "12", "--max-model-len", "256", "--generate-batch", "4", "--steps", "1",
              "--tokens-per-batch", "1024"]
    assert main(common + ["--out", str(again), "--init-head", str(out), "--learning-rate", "0"]) == 0
    first, continued = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == continued.keys()
    for name in first:
        np.testing.assert_array_equal(first[name], continued[name], err_msg=name)
    config = json.loads((out / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="init_head=.*reads target layers"):
        main(common + ["--out", str(tmp_path / "never"), "--init-head", str(out)])
