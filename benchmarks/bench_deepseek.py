"""DeepSeek targets with random weights: the decode step of DeepSeek-V3 at full width with 4 layers (1 dense +
3 MoE) in FP8 against its floor, DeepSeek-V2-Lite's shape (27 layers, 64 routed + 2 shared experts) in bf16 end
to end, both with the grouped matmul kernel on and off, and V2-Lite with one MTP layer drafting at synthetic
acceptance lengths against the ideal AL / (t_verify + k t_mtp). Steps are timed on rows of distinct random
tokens, so that the rows route to different experts (rows of one token all choose the same ones).

The floor counts the bytes a step must read: every weight except the routed experts, the distinct routed experts
the batch selects (counted by routing random hidden states through each MoE layer's own router) and the latent
cache, over the copy bandwidth measured in the same process.

    PYTHONPATH=. python benchmarks/bench_deepseek.py [--suites v3_step,v2_e2e,mtp,v2_transformers] [--smoke]
        [--forms kernel,xla,fp8_rows,head_kernel,programsN] [--batches B ...] [--profile] [--loop B ...]
        [--target h200]

(--forms: which forms v3_step and v2_e2e time: the grouped matmul kernel, XLA's with it off, the kernel on FP8 rows
(fp8_rows), the kernel with MLA's per-head products in it too (head_kernel), the kernel with MLA's latent rows in
XLA's launches instead of their one kernel (split_latent), the same for the MLPs' SwiGLU rows (split_swiglu), the
kernel with each single FP8 projection's K split aiming at N programs (programsN); default kernel,xla. --profile:
v3_step also traces 5 steps of the kernel form at each batch, v2_e2e its plain loops, and writes where the device
time goes, per kernel kind. --loop: v3_step also times each form's step inside plain decoding's generate loop at
these batches, as the engine runs it (the whole loop one CUDA graph on a GPU), against the same floor.)

(v2_transformers, transformers' own V2-Lite as the peer, runs in a child process first. --target h200 runs
nothing: it compiles v3_step's forms for an H200 on this host, from shapes alone (no weights are made), and
prints the launches of a step by the function that made them; benchmarks/gpu_target.py says what that needs.)

Writes $OUT/bench_deepseek_<suite>.json and prints each row as it comes.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.bench_engine import (SMOKE_SIZES, Sizes, acceptance_sweep, e2e_suite, head_step_time, plain_times,
                                     run_plain, step_fn, step_time, stepper, subject)
from benchmarks.common import copy_bandwidth, print_table, write_json
from benchmarks.device_trace import busy_ns, by_kernel, traced_kernels
from benchmarks.gpu_target import compiled_for, compiling_for, h200
from benchmarks.hlo_source import charged_weights, instruction_stacks, launches_per_call
from specjax.engine.proposers.eagle import HeadProposer
from specjax.kernels.policy import KernelPolicy
from specjax.models.deepseek import FAMILY, DeepseekConfig
from specjax.models.family import Frozen
from specjax.models.moe import route
from specjax.models.mtp import MtpConfig, MtpHead

SUITES = ("v3_step", "v2_e2e", "mtp", "v2_transformers")
FORMS = ("kernel", "xla", "fp8_rows", "head_kernel", "split_latent", "split_swiglu")
DEFAULT_FORMS = ("kernel", "xla")
YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}
# DeepSeek-V3's config.json, 4 layers instead of 61, the first one dense (V3 has 3).
V3_4_LAYERS = {
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 128,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}, "max_position_embeddings": 163840,
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
    "num_nextn_predict_layers": 1,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]}}
# DeepSeek-V2-Lite's config.json (15.7 B parameters, 2.4 B active), with one MTP layer declared for the mtp suite.
V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2, "n_group": 1, "topk_group": 1,
    "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {**YARN, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707},
    "max_position_embeddings": 163840, "tie_word_embeddings": False, "bos_token_id": 100000,
    "eos_token_id": 100001, "torch_dtype": "bfloat16", "num_nextn_predict_layers": 1}
# The same two shapes shrunk for --smoke (the FP8 block kept at 128: every quantized dim is a multiple of it).
SMOKE = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 128,
         "num_attention_heads": 2, "q_lora_rank": 128, "kv_lora_rank": 128, "qk_nope_head_dim": 32,
         "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
         "topk_group": 1, "num_hidden_layers": 2}
V3_BATCHES, V2_BATCHES = (1, 8, 32, 128), (1, 8)
CONTEXT = 1024


def config(d: dict, smoke: bool) -> DeepseekConfig:
    if smoke:
        d = {**d, **SMOKE, "q_lora_rank": SMOKE["q_lora_rank"] if d["q_lora_rank"] else None}
    return DeepseekConfig.from_hf_dict(d)


def leaves(state) -> dict[str, jax.Array]:
    """A model state's weight leaves by path (the same for stacked and unrolled layers, up to layer indices)."""
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]
    return {"/".join(str(getattr(key, "key", key)) for key in path): leaf for path, leaf in flat}


def distinct_experts(weights: dict[str, jax.Array], cfg: DeepseekConfig, B: int, T: int = 1) -> float:
    """The mean number of distinct routed experts per MoE layer that B rows of T tokens select, routing random
    unit-variance hidden states through each layer's own router."""
    routers = sorted(path for path in weights if path.endswith("w_router"))
    x = jax.random.normal(jax.random.key(7), (B * T, cfg.hidden_size), jnp.float32)
    counts = []
    for path in routers:
        bias = weights.get(path.replace("w_router", "router_bias"))
        router = weights[path].reshape(-1, cfg.hidden_size, cfg.n_routed_experts)
        for layer in range(router.shape[0]):
            ids, _ = route(x, router[layer], None if bias is None else bias.reshape(router.shape[0], -1)[layer],
                           cfg.routing)
            counts.append(len(np.unique(np.asarray(ids))))
    return float(np.mean(counts)) if counts else 0.0


def floor_bytes(weights: dict[str, jax.Array], cfg: DeepseekConfig, distinct: float, B: int, T: int, context: int) -> float:
    """Bytes one step reads: the weights but the routed experts and the embedding whole, `distinct` experts per
    MoE layer, B*T embedding rows, and the latent cache up to context + T (bf16)."""
    sizes = {path: leaf.nbytes for path, leaf in weights.items()}
    routed = sum(n for path, n in sizes.items() if path.split("/")[-1].startswith("we_"))
    embed = sizes["embed"]
    rest = sum(sizes.values()) - routed - embed
    per_expert_all_layers = routed / cfg.n_routed_experts
    latent = B * (context + T) * cfg.latent_width * 2 * cfg.num_layers
    return rest + distinct * per_expert_all_layers + B * T * embed / cfg.vocab_size + latent


def stepped_subject(cfg: DeepseekConfig):
    """The target as the engine runs it here (layers unrolled on GPUs, scanned elsewhere) and its weights."""
    graph, state = nnx.split(FAMILY.random(cfg, dtype=jnp.bfloat16))
    return leaves(state), subject(cfg, graph, state)


def form_subjects(cfg: DeepseekConfig, target, forms: tuple[str, ...]) -> dict:
    """The target under each of `forms`: "kernel" as built, "xla" the same weights with the experts and the
    few-row projections compiled by XLA (the grouped matmul kernel off), "fp8_rows" the kernel multiplying FP8
    stacks by rows quantized to FP8 (KernelPolicy.fp8_activations; the same as "kernel" for a bf16 model),
    "head_kernel" the kernel running MLA's W_UK / W_UV products too (KernelPolicy.head_matmul_max_tokens),
    "split_latent" the kernel with MLA's latent rows in XLA's separate launches (KernelPolicy.latent_rows_kernel),
    "split_swiglu" the same for the MLPs' SwiGLU rows (KernelPolicy.swiglu_rows_kernel),
    "programsN" the kernel with each single FP8 projection's K split aiming at N programs
    (KernelPolicy.projection_programs)."""
    def under(policy: KernelPolicy):
        graph = nnx.graphdef(nnx.eval_shape(lambda: FAMILY.random(cfg, dtype=jnp.bfloat16, kernels=policy)))
        return subject(cfg, graph, target.state)
    return {form: target if form == "kernel" else under(form_policy(form)) for form in forms}


def form_policy(form: str) -> KernelPolicy:
    """The kernel policy of one of form_subjects' forms."""
    policies = {"kernel": KernelPolicy(), "xla": KernelPolicy(grouped_matmul_kernel=False),
                "fp8_rows": KernelPolicy(fp8_activations=True), "head_kernel": KernelPolicy(head_matmul_max_tokens=64),
                "split_latent": KernelPolicy(latent_rows_kernel=False),
                "split_swiglu": KernelPolicy(swiglu_rows_kernel=False)}
    return policies[form] if form in policies else KernelPolicy(projection_programs=programs_of(form))


def programs_of(form: str) -> int | None:
    """N of a "programsN" form (None for any other name)."""
    match = re.fullmatch(r"programs([1-9]\d*)", form)
    return int(match.group(1)) if match else None


STEPS_TRACED = 5
LOOP_TOKENS = 33   # new tokens per row where the loop is timed: the first (left out), then 32 steps


def v3_step_suite(bandwidth: float, smoke: bool, batches: tuple[int, ...], forms: tuple[str, ...] = DEFAULT_FORMS,
                  profile: bool = False, loop_batches: tuple[int, ...] = ()) -> list[dict]:
    """Decode steps of rows of distinct random tokens (so that rows route apart), the grouped matmul kernel on and
    off (`forms`); with `profile`, where each form's steps spend their device time (kernel by kernel: the
    profiler's times, unlike step times across processes, compare forms to a microsecond); at `loop_batches`,
    also the step as the engine runs it: plain decoding's generate loop (one CUDA graph on a GPU) per step."""
    cfg = config(V3_4_LAYERS, smoke)
    weights, target = stepped_subject(cfg)
    subjects = form_subjects(cfg, target, forms)
    if profile:
        traced = {(form, B): step_kernels(model, B) for form, model in subjects.items() for B in batches}
        profiles = [profile_row(kernels, STEPS_TRACED, form=form, batch=B) for (form, B), kernels in traced.items()]
        print_table(profiles)
        write_json("bench_deepseek_v3_profile", profiles)
        write_json("bench_deepseek_v3_launches", [dict(form=form, batch=B, step=last_step(kernels, STEPS_TRACED))
                                                  for (form, B), kernels in traced.items()])
    rows = []
    for B in batches:
        distinct = distinct_experts(weights, cfg, B)
        floor = floor_bytes(weights, cfg, distinct, B, 1, CONTEXT) / bandwidth
        for experts, model in subjects.items():
            t = step_time(model, B, 1, CONTEXT, distinct_tokens=True)
            rows.append(dict(shape="v3_4layers_fp8", batch=B, experts=experts, context=CONTEXT,
                             distinct_experts=distinct, ms=1e3 * t, floor_ms=1e3 * floor, roofline_frac=floor / t,
                             weights_GB=sum(leaf.nbytes for leaf in weights.values()) / 1e9))
            if B in loop_batches:
                t_loop = loop_step_time(model, B, smoke)
                rows[-1].update(loop_ms=1e3 * t_loop, loop_roofline_frac=floor / t_loop)
            print(rows[-1], flush=True)
    return rows


def v3_step_launches(batches: tuple[int, ...], smoke: bool, forms: tuple[str, ...] = ("kernel",)) -> list[dict]:
    """V3's 4-layer FP8 decode step in each of `forms` compiled for an H200 here, from shapes: launches per step,
    in all and by the innermost function that made them."""
    cfg = config(V3_4_LAYERS, smoke)
    device = h200()
    rows = []
    with compiling_for(device):
        for form, B in itertools.product(forms, batches):
            graph, state = nnx.split(nnx.eval_shape(
                lambda: FAMILY.random(cfg, dtype=jnp.bfloat16, kernels=form_policy(form))))
            cache = jax.eval_shape(lambda s: nnx.merge(graph, s).init_cache(B, CONTEXT + 1), state)
            text = compiled_for(step_fn(graph), (state, cache, jax.ShapeDtypeStruct((B, 1), jnp.int32),
                                                 jax.ShapeDtypeStruct((B,), jnp.int32)), device).as_text()
            launches = launches_per_call(text)
            by_function = charged_weights(launches.items(), instruction_stacks(text))
            rows.append(dict(shape="v3_4layers_fp8", form=form, batch=B, target="h200", launches=sum(launches.values()),
                             by_function=dict(by_function.most_common())))
            print(rows[-1], flush=True)
    return rows


def loop_step_time(model, B: int, smoke: bool) -> float:
    """Seconds per step of plain decoding's generate loop over B random prompts of CONTEXT tokens (LOOP_TOKENS
    new tokens, the prefill and first token left out: e2e_suite's ms_per_step): the decode step with the loop's
    sampling and bookkeeping around it, one graph launch for the whole loop. Greedy rows of random weights may
    repeat tokens and share experts, so past batch 1 the floor of distinct rows' experts can overstate what the
    loop reads."""
    sizes = SMOKE_SIZES if smoke else Sizes(prompt_len=CONTEXT, new_tokens=LOOP_TOKENS)
    return e2e_suite(model, (B,), sizes)[0]["ms_per_step"] / 1e3


def step_kernels(model, B: int) -> list:
    """The kernels of STEPS_TRACED decode steps at CONTEXT (rows of distinct tokens), in start order."""
    return traced_kernels(stepper(model, B, 1, CONTEXT, distinct_tokens=True, steps=STEPS_TRACED))


def last_step(kernels, steps: int) -> list[tuple[str, str, float]]:
    """(kernel, HLO instruction, us) of the last of `steps` equal steps' launches, in order: what each took."""
    per_step = len(kernels) // steps
    return [(k.name[:60], k.op, round(k.duration_ns / 1e3, 2)) for k in kernels[-per_step:]]


def loop_profile(model, B: int, sizes_run: Sizes) -> dict:
    """Where the plain loop (its prefill included) spends its device time, per generated token, from a profiler
    trace of run_plain's four generate calls."""
    kernels = traced_kernels(lambda: run_plain(model, B, sizes_run.prompt_len, sizes_run.new_tokens))
    return profile_row(kernels, 4 * sizes_run.new_tokens, batch=B)


def profile_row(kernels, per: int, **key) -> dict:
    """Kernels and device busy time per `per`, and the 12 largest kernel kinds' (count, us) per `per`."""
    kinds = by_kernel(kernels, per=per, top=12)
    return dict(**key, kernels=len(kernels) / per, busy_us=busy_ns(kernels) / per / 1e3,
                **{f"{row['kernel'][:48]} (n, us)": (row["count"], round(row["us"], 1)) for row in kinds})


def v2_e2e_suite(bandwidth: float, smoke: bool, sizes_run: Sizes, batches: tuple[int, ...],
                 forms: tuple[str, ...] = DEFAULT_FORMS, profile: bool = False) -> list[dict]:
    cfg = config(V2_LITE, smoke)
    weights, target = stepped_subject(cfg)
    subjects = form_subjects(cfg, target, forms)
    rows = []
    for B in batches:
        distinct = distinct_experts(weights, cfg, B)
        context = sizes_run.prompt_len + sizes_run.new_tokens // 2
        floor = floor_bytes(weights, cfg, distinct, B, 1, context) / bandwidth
        for experts, model in subjects.items():
            first, steady, steps = run_plain(model, B, sizes_run.prompt_len, sizes_run.new_tokens)
            t_step = step_time(model, B, 1, context, distinct_tokens=True)
            rows.append(dict(shape="v2_lite_bf16", batch=B, experts=experts, new_tokens=sizes_run.new_tokens,
                             tok_s=B * sizes_run.new_tokens / steady, step_ms=1e3 * t_step, floor_ms=1e3 * floor,
                             roofline_frac=floor / t_step, distinct_experts=distinct, compile_s=first - steady))
            print(rows[-1], flush=True)
    if profile:
        profiles = [loop_profile(target, B, sizes_run) for B in batches]
        print_table(profiles)
        write_json("bench_deepseek_v2_profile", profiles)
    return rows


def hf_config(d: dict, smoke: bool):
    """transformers' DeepseekV2Config for the config.json dict `d` (--smoke's shrunk one)."""
    from transformers import DeepseekV2Config
    fields = {**d, **(SMOKE if smoke else {})}
    rope_scaling = fields.pop("rope_scaling")
    fields["rope_parameters"] = {"rope_type": rope_scaling["type"], "rope_theta": fields.pop("rope_theta"),
                                 **{k: v for k, v in rope_scaling.items() if k != "type"}}
    for key in ("architectures", "torch_dtype", "num_nextn_predict_layers"):
        fields.pop(key)
    return DeepseekV2Config(**fields)


def v2_transformers_suite(smoke: bool, sizes_run: Sizes, batches: tuple[int, ...]) -> list[dict]:
    """transformers' own DeepseekV2ForCausalLM at V2-Lite's shape (its own random bf16 weights: the timing depends
    on shapes and on how many experts the rows select, not on the values), greedy `generate` with its default
    cache, on the GPU where there is one. Run it in a process of its own (JAX preallocates most of the GPU)."""
    import time

    import torch
    from transformers import DeepseekV2ForCausalLM
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = DeepseekV2ForCausalLM._from_config(hf_config(V2_LITE, smoke), dtype=torch.bfloat16).eval()
    rows = []
    for B in batches:
        prompt = torch.randint(3, model.config.vocab_size, (B, sizes_run.prompt_len), device=device)

        def generate(new_tokens: int) -> float:
            begin = time.perf_counter()
            with torch.no_grad():
                model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False)
            if device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - begin

        generate(4)
        seconds = generate(sizes_run.new_tokens)
        rows.append(dict(shape="v2_lite_bf16", batch=B, engine="transformers generate", device=device,
                         new_tokens=sizes_run.new_tokens, tok_s=B * sizes_run.new_tokens / seconds))
        print(rows[-1], flush=True)
    return rows


def mtp_suite(smoke: bool, sizes_run: Sizes, batches: tuple[int, ...]) -> list[dict]:
    """V2-Lite drafting with one MTP layer (random, sharing the target's embedding and lm_head as the engine binds
    them, so that its drafts are tokens as varied as a trained layer's and route the verify pass to as many
    experts): k = 1, 2, 3 (--smoke: 1) at synthetic acceptance 1.5 / 2.5 / 3.5 (those a k allows)."""
    cfg = config(V2_LITE, smoke)
    weights, target = stepped_subject(cfg)
    head = MtpHead(MtpConfig(target=cfg, num_mtp_layers=1), dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
    head.embed, head.lm_head = Frozen(weights["embed"]), Frozen(weights["lm_head"])
    hgraph, hstate = nnx.split(head)
    context = sizes_run.prompt_len + sizes_run.new_tokens // 2
    rows = []
    for B in batches:
        plain = plain_times(target, B, sizes_run)
        t_mtp = head_step_time(hgraph, hstate, head, B, context, distinct_tokens=True)
        for k in (1,) if smoke else (1, 2, 3):
            t_verify = step_time(target, B, k + 1, context, distinct_tokens=True)
            rows += acceptance_sweep(target, HeadProposer(hgraph, head, k, probabilistic=False), hstate, B, plain,
                                     t_verify, t_mtp, sizes_run, lengths=[al for al in (1.5, 2.5, 3.5) if al <= k + 1],
                                     shape="v2_lite+mtp")
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--suites", default=",".join(SUITES))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, batch 1, to check the script on CPU")
    parser.add_argument("--forms", default=",".join(DEFAULT_FORMS),
                        help="v3_step's and v2_e2e's forms: kernel, xla, fp8_rows, head_kernel, split_latent, "
                        "split_swiglu, programsN")
    parser.add_argument("--batches", type=int, nargs="+", help="batch sizes (default: 1 8 32 128 for v3_step, 1 8 "
                        "for the V2-Lite suites; --smoke: 1)")
    parser.add_argument("--profile", action="store_true", help="trace each form's steps (v3_step) or the kernel "
                        "form's loops (v2_e2e) too")
    parser.add_argument("--loop", type=int, nargs="+", default=(), metavar="B",
                        help="v3_step: also time plain decoding's loop per step at these batches (--smoke: 1)")
    parser.add_argument("--target", choices=["h200"], help="compile v3_step's forms for this GPU here and count "
                        "their launches; nothing runs")
    args = parser.parse_args(argv)

    def batches(default: tuple[int, ...]) -> tuple[int, ...]:
        return (1,) if args.smoke else tuple(args.batches or default)
    forms = tuple(args.forms.split(","))
    if not all(form in FORMS or programs_of(form) for form in forms):
        raise SystemExit(f"--forms: {args.forms!r}; choose from {', '.join(FORMS)} or programsN (N a count)")
    if args.target:
        rows = v3_step_launches(batches(V3_BATCHES), args.smoke, forms)
        print_table([{k: r[k] for k in ("shape", "form", "batch", "launches")} for r in rows])
        write_json("bench_deepseek_v3_target", rows)
        return
    sizes = SMOKE_SIZES if args.smoke else dataclasses.replace(Sizes(), new_tokens=128)
    suites = args.suites.split(",")
    if "v2_transformers" in suites:   # PyTorch in a process of its own, before JAX takes the GPU's memory here
        if suites == ["v2_transformers"]:
            rows = v2_transformers_suite(args.smoke, sizes, batches(V2_BATCHES))
            print_table(rows)
            write_json("bench_deepseek_v2_transformers", rows)
            return
        subprocess.run([sys.executable, __file__, "--suites", "v2_transformers"] + ["--smoke"] * args.smoke
                       + ["--batches", *map(str, batches(V2_BATCHES))], check=True)
        suites.remove("v2_transformers")
    bandwidth = copy_bandwidth(1 << 26) if args.smoke else copy_bandwidth()
    print(f"{jax.devices()[0].device_kind}: copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    for suite in suites:
        if suite == "v3_step":
            loop = (1,) if args.smoke and args.loop else tuple(args.loop)
            rows = v3_step_suite(bandwidth, args.smoke, batches(V3_BATCHES), forms, args.profile, loop)
        elif suite == "v2_e2e":
            rows = v2_e2e_suite(bandwidth, args.smoke, sizes, batches(V2_BATCHES), forms, args.profile)
        elif suite == "mtp":
            rows = mtp_suite(args.smoke, sizes, batches(V2_BATCHES))
        else:
            raise SystemExit(f"--suites: unknown suite {suite!r}; choose from {', '.join(SUITES)}")
        for r in rows:
            r["copy_TBps"] = bandwidth / 1e12
        print_table(rows)
        write_json(f"bench_deepseek_{suite}", rows)


if __name__ == "__main__":
    main()
