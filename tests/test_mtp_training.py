"""MTP head training for a Llama-family target: recording only the final hidden states, training-time test that
drafts as MTP inference does (the layer rerun on its own output), the MiMo-layout head directory round-tripping,
and the entry point with --method mtp end to end, its head loadable by the engine."""
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
from checkpoints_conv.mtp_loader import load_mtp_head
from checkpoints_conv.mtp_writer import save_mtp_head
from specjax import LLM, SamplingParams
from specjax.models.llama import FAMILY, LlamaConfig
from specjax.training.__main__ import main
from specjax.training.features import FeatureWriter, open_features
from specjax.training.record import record
from specjax.training.trainer import TrainConfig, Trainer, make_batch, new_mtp_head, ttt_forward

TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=61, hidden_size=32, intermediate_size=48,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
            rope_theta=1e4, tie_word_embeddings=False, max_position_embeddings=256, eos_token_id=2)
TINY_CFG = LlamaConfig.from_hf_dict(TINY)
PROMPTS = [[5, 9, 11, 7, 30], [40, 3], [8, 8, 21, 17, 33, 50, 12, 6, 44]]


@pytest.fixture(scope="module")
def tiny_target():
    graph, state = nnx.split(FAMILY.random(TINY_CFG, seed=1))
    return graph, jax.tree.map(lambda x: x * 3, state)


@pytest.fixture(scope="module")
def recorded(tiny_target, tmp_path_factory):
    llm = types.SimpleNamespace(model_config=TINY_CFG, max_model_len=64, target_graph=tiny_target[0],
                                params=tiny_target[1], eos_token_ids=[2])
    path = tmp_path_factory.mktemp("mtp_features")
    writer = FeatureWriter(path, 200, TINY_CFG.hidden_size, ())
    record(llm, PROMPTS, 16, (), writer, batch=2)
    return open_features(path)


def test_recording_for_mtp_keeps_the_final_states_alone(tiny_target, recorded):
    assert recorded.aux.shape == (200, 0) and recorded.num_examples == 3
    target = nnx.merge(*tiny_target)
    tokens = recorded.tokens[recorded.offsets[2]:recorded.offsets[3]]
    hidden, _, _ = target(jnp.asarray(tokens[None]), jnp.zeros((1,), jnp.int32), target.init_cache(1, len(tokens)))
    span = slice(recorded.offsets[2], recorded.offsets[3] - 1)
    np.testing.assert_allclose(recorded.final[span], hidden[0, :-1], rtol=2e-3, atol=2e-3)


def test_training_time_test_drafts_as_mtp_inference(tiny_target, recorded):
    """TTT step j at index t equals MTP drafting step j after the tokens up to t+1: step 0 reads the target's
    final state at t, later steps the layer's own output, over the head's KV cache."""
    head = new_mtp_head(TINY_CFG, tiny_target[1], seed=3)
    batch = make_batch(recorded, [2])
    assert_ttt_drafts_as_inference(head, jnp.asarray(batch.tokens), jnp.asarray(batch.final, jnp.float32), 3)


def test_mtp_training_lowers_the_loss_and_round_trips_through_the_mimo_layout(tiny_target, recorded, tmp_path):
    head = new_mtp_head(TINY_CFG, tiny_target[1])
    trainer = Trainer(head, TINY_CFG, tiny_target[1], TrainConfig(total_steps=30, learning_rate=3e-3,
                                                                   warmup_steps=1))
    batch = make_batch(recorded, [0, 1, 2])
    metrics = [trainer.step(batch) for _ in range(30)]
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.3 and metrics[-1]["acc_0"] > metrics[0]["acc_0"]
    trained = trainer.head()
    out = save_mtp_head(trained, tmp_path / "MTP-tiny", TINY, dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["architectures"] == ["LlamaForCausalLM"]
    names = set(load_file(out / "model.safetensors"))
    assert {"model.mtp_layers.0.input_proj.weight", "model.mtp_layers.0.self_attn.q_proj.weight",
            "model.mtp_layers.0.mlp.down_proj.weight", "model.mtp_layers.0.final_layernorm.weight"} <= names
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
    loaded = load_mtp_head(out, TINY_CFG, tiny_target[1], np.float32)
    tokens, final = jnp.asarray(batch.tokens), jnp.asarray(batch.final, jnp.float32)
    for mine, theirs in zip(ttt_forward(loaded, tokens, final, 2), ttt_forward(trained, tokens, final, 2)):
        np.testing.assert_allclose(loaded.logits(mine), trained.logits(theirs), rtol=1e-4, atol=1e-4)


def test_mtp_training_entry_point_runs_end_to_end(tiny_chat_model, tmp_path):
    """python -m specjax.training --method mtp on a tiny configuration (a 4-layer random target with the
    default model's tokenizer); the engine then drafts with the head
    (method "mtp", model = the head directory) and its greedy output equals plain decoding."""
    out, work = tmp_path / "MTP-head", tmp_path / "work"
    assert main(["--method", "mtp", "--target", str(tiny_chat_model), "--prompts",
                 str(GSM8K), "--out", str(out), "--work", str(work), "--num-train", "4",
                 "--num-heldout", "3", "--num-eval", "2", "--max-new-tokens", "12", "--max-model-len", "256",
                 "--generate-batch", "4", "--steps", "2", "--log-every", "1", "--tokens-per-batch", "512"]) == 0
    log = [json.loads(line) for line in (work / "log.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in log] == ["data", "train", "train", "eval"]
    assert json.loads((work / "features" / "meta.json").read_text())["aux_layer_ids"] == []
    assert log[-1]["num_drafts"] > 0 and 1.0 <= log[-1]["acceptance_length"] <= 4.0
    prompt = [{"prompt_token_ids": [1, 504, 3458, 314, 253, 2330, 28, 1]}]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = LLM(str(tiny_chat_model), max_model_len=128, max_num_seqs=1).generate(prompt, greedy)
    mtp = LLM(str(tiny_chat_model), max_model_len=128, max_num_seqs=1,
              speculative_config={"method": "mtp", "model": str(out), "num_speculative_tokens": 2})
    assert mtp.generate(prompt, greedy)[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="method must be one of"):
        main(["--method", "medusa", "--prompts", "x", "--out", str(tmp_path / "n"), "--work", str(tmp_path / "w")])
