"""HF safetensors -> param tree: names, transposes, stacking, dtypes, shards, errors, orbax, placement."""
from __future__ import annotations

import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from checkpoints_conv import (convert_hf_to_orbax, is_orbax_checkpoint, load_checkpoint, load_params, restore_params,
                              save_params)
from checkpoints_conv.cli import main as cli_main
from conftest import TINY_FAMILIES
from specjax.config.dtypes import resolve_dtype
from specjax.models.registry import config_from_dir, config_from_hf


def config_of(model_dir):
    return config_from_dir(model_dir)[1]


def load(model_dir, cfg=None, dtype="auto", shardings=None):
    """load_params with the model directory's own family, config and dtype resolution."""
    family, own = config_from_dir(model_dir)
    cfg = cfg or own
    return load_params(model_dir, family.weight_map(cfg), resolve_dtype(dtype, cfg.torch_dtype), shardings,
                       family.ignored_tensors(cfg))


def load_ckpt(model_dir, cfg, dtype="auto"):
    family, _ = config_from_dir(model_dir)
    return load_checkpoint(model_dir, family.weight_map(cfg), resolve_dtype(dtype, cfg.torch_dtype))


def hf_tensors(model_dir) -> dict[str, np.ndarray]:
    """All tensors of a (possibly sharded) checkpoint, read independently of the loader."""
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def expected_leaf(tensors: dict, spec, num_layers: int) -> np.ndarray:
    """The leaf built here by hand: each layer's tensors transposed, fused ones interleaved group by group."""
    def one(fields):
        parts = [tensors[name.format(**fields)] for name in spec.hf_names]
        parts = [p.T if spec.transpose else p for p in parts]
        if len(parts) == 1:
            return parts[0]
        lead = parts[0].shape[:-1]
        return np.concatenate([np.concatenate([p.reshape(*lead, spec.groups, -1)[..., g, :] for p in parts], -1)
                               for g in range(spec.groups)], axis=-1)

    if not spec.stacked:
        return one({})
    return np.stack([one({"i": i}) for i in range(num_layers)])


def leaves_by_path(tree: dict) -> dict[str, jax.Array]:
    return {"/".join(k.key for k in path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_every_leaf_is_the_renamed_transposed_stacked_hf_tensor(tiny_checkpoint_factory, family):
    model_dir = tiny_checkpoint_factory(family)
    cfg = config_of(model_dir)
    params = leaves_by_path(load(model_dir, cfg))
    tensors = hf_tensors(model_dir)
    specs = config_from_dir(model_dir)[0].weight_map(cfg)
    assert set(params) == set(specs)
    used = set()
    for path, spec in specs.items():
        want = expected_leaf(tensors, spec, cfg.num_layers)
        assert params[path].shape == spec.shape and params[path].dtype == np.float32, path
        np.testing.assert_array_equal(np.asarray(params[path]), want, err_msg=path)
        used |= {name.format(i=i) for name in spec.hf_names for i in range(cfg.num_layers)}
    # Every tensor of the checkpoint is used (tied models have no lm_head.weight in the file).
    assert used == set(tensors)


def test_family_specific_leaves(tiny_checkpoint_factory):
    def paths(family):
        model_dir = tiny_checkpoint_factory(family)
        return set(leaves_by_path(load(model_dir, config_of(model_dir))))

    assert "layers/b_qkv" in paths("qwen2")
    assert {"layers/q_norm", "layers/k_norm"} <= paths("qwen3")
    assert "lm_head" not in paths("qwen2") and "lm_head" not in paths("llama3_tied")
    assert "lm_head" in paths("llama") and not {"layers/b_qkv", "layers/q_norm"} & paths("llama")


@pytest.mark.parametrize("dtype, expected", [("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16),
                                             ("float32", np.float32), ("auto", np.float32)])
def test_dtype_cast(tiny_checkpoint_factory, dtype, expected):
    model_dir = tiny_checkpoint_factory("qwen3")
    cfg = config_of(model_dir)
    params = leaves_by_path(load(model_dir, cfg, dtype=dtype))
    reference = leaves_by_path(load(model_dir, cfg, dtype="float32"))
    for path, leaf in params.items():
        assert leaf.dtype == expected, path
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(reference[path]).astype(expected))


def test_bfloat16_checkpoint_reads(tmp_path, tiny_checkpoint_factory):
    src = tiny_checkpoint_factory("llama")
    model_dir = copy_checkpoint(src, tmp_path / "bf16")
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(src / "model.safetensors").items()}
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (model_dir / "config.json").write_text(json.dumps(config))
    cfg = config_of(model_dir)
    params = leaves_by_path(load(model_dir, cfg))   # auto -> bfloat16
    assert params["layers/wo"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(np.asarray(params["layers/wo"][1]),
                                  tensors["model.layers.1.self_attn.o_proj.weight"].T)


def test_unknown_dtype_is_rejected(tiny_checkpoint_factory):
    model_dir = tiny_checkpoint_factory("llama")
    with pytest.raises(ValueError, match="dtype must be one of .* got 'int8'"):
        load(model_dir, config_of(model_dir), dtype="int8")


def test_sharded_checkpoint_equals_single_file(tiny_checkpoint_factory):
    sharded = tiny_checkpoint_factory("llama", max_shard_size="20KB")
    single = tiny_checkpoint_factory("llama")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    cfg = config_of(single)
    a, b = leaves_by_path(load(sharded, cfg)), leaves_by_path(load(single, cfg))
    assert a.keys() == b.keys()
    for path in a:
        np.testing.assert_array_equal(np.asarray(a[path]), np.asarray(b[path]), err_msg=path)


def test_missing_shard_listed_in_index(tmp_path, tiny_checkpoint_factory):
    model_dir = copy_checkpoint(tiny_checkpoint_factory("llama", max_shard_size="20KB"), tmp_path / "m")
    victim = sorted(model_dir.glob("model-*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        load(model_dir, config_of(model_dir))


@pytest.mark.parametrize("keep_bytes", [0, 7, 100, -1000])
def test_truncated_file_is_a_clear_error(tmp_path, tiny_checkpoint_factory, keep_bytes):
    model_dir = copy_checkpoint(tiny_checkpoint_factory("llama"), tmp_path / "m")
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:keep_bytes] if keep_bytes >= 0 else data[:keep_bytes])
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated or corrupt"):
        load(model_dir, config_of(model_dir))


def test_wrong_shape_names_tensor_expected_and_got(tmp_path, tiny_checkpoint_factory):
    model_dir = copy_checkpoint(tiny_checkpoint_factory("llama"), tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config["intermediate_size"] = 40
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"gate_proj\.weight.*shape \(48, 32\), expected \(40, 32\)"):
        load(model_dir, config_of(model_dir))


def test_missing_tensor_is_named(tmp_path, tiny_checkpoint_factory):
    model_dir = copy_checkpoint(tiny_checkpoint_factory("llama"), tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        load(model_dir, config_of(model_dir))


def test_missing_directory_and_missing_weights(tmp_path, tiny_checkpoint_factory):
    cfg = config_of(tiny_checkpoint_factory("llama"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(tmp_path / "nowhere", cfg)
    (tmp_path / "empty").mkdir()
    shutil.copy(tiny_checkpoint_factory("llama") / "config.json", tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files"):
        load(tmp_path / "empty", cfg)


def test_unsupported_architecture(tiny_checkpoint_factory):
    config = json.loads((tiny_checkpoint_factory("llama") / "config.json").read_text())
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        config_from_hf({**config, "architectures": ["GPT2LMHeadModel"]})


def single_device_shardings(params: dict, device) -> dict:
    return jax.tree_util.tree_map(lambda _: jax.sharding.SingleDeviceSharding(device), params)


def test_each_leaf_lands_on_its_sharding(tiny_checkpoint_factory):
    model_dir = tiny_checkpoint_factory("qwen2")
    cfg = config_of(model_dir)
    device = jax.devices()[-1]   # not the default device when several exist (XLA host device count)
    shardings = single_device_shardings(load(model_dir, cfg), device)
    shardings["layers"]["w_qkv"] = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = load(model_dir, cfg, shardings=shardings)
    for path, leaf in leaves_by_path(params).items():
        assert leaf.sharding == leaves_by_path(shardings)[path], path
    del shardings["layers"]["b_qkv"]
    with pytest.raises(ValueError, match="layers/b_qkv"):
        load(model_dir, cfg, shardings=shardings)


def test_orbax_round_trip_is_exact_and_placed(tmp_path, tiny_checkpoint_factory):
    model_dir = tiny_checkpoint_factory("qwen3")
    cfg = config_of(model_dir)
    params = load(model_dir, cfg, dtype="bfloat16")
    save_params(params, tmp_path / "ckpt")
    assert is_orbax_checkpoint(tmp_path / "ckpt") and not is_orbax_checkpoint(model_dir)
    shardings = single_device_shardings(params, jax.devices()[-1])
    restored = restore_params(tmp_path / "ckpt", shardings=shardings)
    original = leaves_by_path(params)
    for path, leaf in leaves_by_path(restored).items():
        assert leaf.dtype == ml_dtypes.bfloat16 and leaf.sharding == leaves_by_path(shardings)[path]
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(original[path]), err_msg=path)
    assert leaves_by_path(restored).keys() == original.keys()


def test_cli_hf_to_orbax_then_load_checkpoint(tmp_path, tiny_checkpoint_factory, capsys):
    model_dir = tiny_checkpoint_factory("llama3_tied")
    out = tmp_path / "converted"
    assert cli_main(["hf-to-orbax", str(model_dir), str(out), "--dtype", "bfloat16"]) == 0
    assert capsys.readouterr().out.strip() == str(out.absolute())
    cfg = config_of(out)
    assert cfg.torch_dtype == "bfloat16" and cfg.rope_scaling == config_of(model_dir).rope_scaling
    restored = leaves_by_path(load_ckpt(out, cfg))
    direct = leaves_by_path(load(model_dir, cfg, dtype="bfloat16"))
    assert restored.keys() == direct.keys()
    for path in direct:
        np.testing.assert_array_equal(np.asarray(restored[path]), np.asarray(direct[path]), err_msg=path)
    as_f32 = leaves_by_path(load_ckpt(out, cfg, dtype="float32"))
    assert all(leaf.dtype == np.float32 for leaf in as_f32.values())
    # A second conversion into the same directory refuses instead of overwriting.
    assert cli_main(["hf-to-orbax", str(model_dir), str(out)]) == 1
    assert "already exists" in capsys.readouterr().err


def test_orbax_checkpoint_that_does_not_match_config(tmp_path, tiny_checkpoint_factory):
    out = convert_hf_to_orbax(tiny_checkpoint_factory("llama"), tmp_path / "converted")
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not match its config.json"):
        load_ckpt(out, config_of(out))


def mesh_shardings(params: dict) -> dict:
    """Column-split every leaf whose last axis divides the device count over a 1-D mesh; replicate the rest."""
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("model",))

    def spec(leaf):
        split = leaf.ndim >= 2 and leaf.shape[-1] % len(devices) == 0
        axes = (None,) * (leaf.ndim - 1) + ("model",) if split else ()
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*axes))

    return jax.tree_util.tree_map(spec, params)


def test_named_shardings_for_load_and_restore(tmp_path, tiny_checkpoint_factory):
    model_dir = tiny_checkpoint_factory("mistral")
    cfg = config_of(model_dir)
    reference = load(model_dir, cfg)
    shardings = mesh_shardings(reference)
    save_params(reference, tmp_path / "ckpt")
    for params in (load(model_dir, cfg, shardings=shardings),
                   restore_params(tmp_path / "ckpt", shardings=shardings)):
        for path, leaf in leaves_by_path(params).items():
            assert leaf.sharding == leaves_by_path(shardings)[path], path
            np.testing.assert_array_equal(np.asarray(leaf), np.asarray(leaves_by_path(reference)[path]))
