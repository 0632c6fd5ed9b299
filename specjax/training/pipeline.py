"""Train a draft head for a target from prompts, end to end: an EAGLE-3 head, or an MTP layer (method "mtp"):

prompts -> held-out split -> the target's greedy responses and hidden states (recorded by the real engine
loop) -> draft vocabulary (EAGLE-3) -> TTT training (optax) -> the head saved in the published EAGLE-3 layout
or MiMo's MTP layout -> acceptance length on the held-out prompts with the real loop. The recording lives in `work_dir/features`
and resumes where an interrupted run stopped; progress bars and a JSON-lines log (work_dir/log.jsonl: loss
and per-step accuracy every log_every steps, acceptance at each evaluation).
"""
from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from checkpoints_conv.eagle_loader import load_eagle_head
from checkpoints_conv.eagle_writer import save_eagle3_head
from checkpoints_conv.mtp_loader import load_mtp_head
from checkpoints_conv.mtp_writer import save_mtp_head
from specjax import LLM
from specjax.hub import resolve_model
from specjax.kernels.policy import KernelPolicy
from specjax.models.eagle import default_aux_layer_ids
from specjax.training import data as data_lib
from specjax.training.evaluate import acceptance
from specjax.training.features import FeatureWriter, open_features
from specjax.training.record import record
from specjax.training.trainer import DraftHead, TrainConfig, Trainer, batches, new_head, new_mtp_head

METHODS = ("eagle3", "mtp")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    target: str                       # model directory / Hub id / None-equivalent default model name
    prompts: str                      # JSON lines with `question` (GSM8K) or `prompt`
    out_dir: str                      # the trained head (EAGLE-3's published layout, or MiMo's MTP layout)
    work_dir: str                     # responses, captured features, log
    num_train: int = 2000
    num_heldout: int = 200
    num_eval: int = 100               # held-out prompts used to measure acceptance
    max_new_tokens: int = 256
    max_model_len: int = 1024
    generate_batch: int = 32
    draft_vocab_size: int = 8192
    steps: int = 2000
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    ttt_steps: int = 3
    tokens_per_batch: int = 4096
    k: int = 3
    eval_every: int = 0               # 0: evaluate at the end only
    save_every: int = 0               # also save the head every N steps without evaluating (0: never)
    log_every: int = 10
    save_dtype: str = "float16"
    seed: int = 0
    init_head: str = ""               # continue from this saved head (an EAGLE-3 head keeps its draft vocabulary)
    method: str = "eagle3"            # "eagle3" or "mtp"


def run(cfg: PipelineConfig) -> dict:
    if cfg.method not in METHODS:
        raise ValueError(f"method must be one of {METHODS} (the heads this pipeline trains), got {cfg.method!r}")
    work, out = Path(cfg.work_dir), Path(cfg.out_dir)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    log = _Log(work / "log.jsonl")
    llm = LLM(cfg.target, max_model_len=cfg.max_model_len, max_num_seqs=cfg.generate_batch)
    tokenizer = llm.get_tokenizer()
    train_q, held_q = data_lib.split_heldout(data_lib.load_questions(cfg.prompts), cfg.num_heldout, cfg.seed)
    train_ids = data_lib.chat_prompt_ids(tokenizer, train_q[:cfg.num_train])
    eval_ids = data_lib.chat_prompt_ids(tokenizer, held_q[:cfg.num_eval])
    target_cfg = llm.model_config
    aux_ids = default_aux_layer_ids(target_cfg.num_layers) if cfg.method == "eagle3" else ()
    head = _initial_head(cfg, target_cfg, llm.params, aux_ids)   # before recording: a bad head fails fast
    capacity = sum(len(p) for p in train_ids) + len(train_ids) * cfg.max_new_tokens
    writer = FeatureWriter(work / "features", capacity, target_cfg.hidden_size, aux_ids)
    record(llm, train_ids, cfg.max_new_tokens, aux_ids, writer, cfg.generate_batch)
    store = open_features(work / "features")
    responses = store.response_tokens()
    if head is None and cfg.method == "mtp":
        head = new_mtp_head(target_cfg, llm.params, seed=cfg.seed)
    if head is None:
        draft_ids = data_lib.draft_vocabulary(responses, store.tokens, target_cfg.vocab_size, cfg.draft_vocab_size)
        head = new_head(target_cfg, llm.params, draft_ids, aux_ids, seed=cfg.seed)
    else:
        draft_ids = (np.asarray(head.draft_to_target[...]) if head.cfg.reduced_vocab
                     else np.arange(head.cfg.draft_vocab_size))
    log.write(stage="data", examples=store.num_examples, tokens=int(store.offsets[-1]),
              response_tokens=len(responses), draft_vocab_coverage=float(np.isin(responses, draft_ids).mean()))
    trainer = Trainer(head, target_cfg, llm.params, TrainConfig(
        total_steps=cfg.steps, learning_rate=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        ttt_steps=cfg.ttt_steps))
    del llm
    target_config = json.loads((resolve_model(cfg.target) / "config.json").read_text())
    result = _train(cfg, trainer, store, log, out, target_config, eval_ids)
    (out / "training.json").write_text(json.dumps({"config": dataclasses.asdict(cfg), **result}, indent=2) + "\n")
    return result


def _initial_head(cfg: PipelineConfig, target_cfg, target_params, aux_ids: tuple[int, ...]) -> DraftHead | None:
    """The head in cfg.init_head, checked against what this run trains (None: start a new one). The
    optimizer starts afresh (warmup included)."""
    if not cfg.init_head:
        return None
    dtype = target_params["embed"][...].dtype
    if cfg.method == "mtp":
        return load_mtp_head(cfg.init_head, target_cfg, target_params, dtype, kernels=KernelPolicy(impl="reference"))
    head = load_eagle_head(cfg.init_head, "eagle3", target_cfg, target_params, dtype,
                           kernels=KernelPolicy(impl="reference"))
    if head.cfg.lm_head_source != "head":
        raise ValueError(f"init_head={cfg.init_head!r} has no lm_head of its own; training continues EAGLE-3 "
                         "heads saved by this pipeline (or published with lm_head.weight)")
    if tuple(head.cfg.aux_layer_ids) != tuple(aux_ids):
        raise ValueError(f"init_head={cfg.init_head!r} reads target layers {list(head.cfg.aux_layer_ids)}, this "
                         f"run records {list(aux_ids)}: use a head trained for this target")
    return head


def _train(cfg: PipelineConfig, trainer: Trainer, store, log: "_Log", out: Path, target_config: dict,
           eval_ids: list[list[int]]) -> dict:
    rng = np.random.default_rng(cfg.seed)
    stream = _endless(store, cfg.tokens_per_batch, rng)
    running: dict[str, float] = {}
    evaluation: dict = {}
    started = time.time()
    save = save_mtp_head if cfg.method == "mtp" else save_eagle3_head
    with tqdm(total=cfg.steps, desc=f"training {cfg.method} head") as bar:
        for step in range(1, cfg.steps + 1):
            metrics = trainer.step(next(stream))
            running = {k: 0.9 * running.get(k, v) + 0.1 * v for k, v in metrics.items()}
            bar.set_postfix(loss=f"{running['loss']:.3f}", acc0=f"{running['acc_0']:.2f}")
            bar.update()
            if step % cfg.log_every == 0 or step == cfg.steps:
                log.write(stage="train", step=step, seconds=round(time.time() - started, 1), **metrics)
            evaluate = step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0)
            if evaluate or (cfg.save_every and step % cfg.save_every == 0):
                save(trainer.head(), out, target_config, cfg.save_dtype)
            if evaluate:
                evaluation = acceptance(cfg.target, out, eval_ids, k=cfg.k, max_new_tokens=cfg.max_new_tokens,
                                        max_model_len=cfg.max_model_len, max_num_seqs=cfg.generate_batch,
                                        method=cfg.method)
                log.write(stage="eval", step=step, **evaluation)
                tqdm.write(f"step {step}: acceptance length {evaluation['acceptance_length']:.3f} at k={cfg.k} "
                           f"on {len(eval_ids)} held-out prompts")
    return {"steps": cfg.steps, "final_metrics": running, "evaluation": evaluation}


def _endless(store, tokens_per_batch: int, rng: np.random.Generator, depth: int = 8):
    """Batches forever, assembled by a background thread up to `depth` ahead: on a GPU, gathering a batch
    from the memory-mapped store takes longer than the step (numpy's copies release the GIL)."""
    ready: queue.Queue = queue.Queue(depth)

    def fill():
        indices = np.arange(store.num_examples)
        while True:
            for batch in batches(store, indices, tokens_per_batch, rng):
                ready.put(batch)

    threading.Thread(target=fill, daemon=True).start()
    while True:
        yield ready.get()


class _Log:
    def __init__(self, path: Path):
        self.path = path

    def write(self, **record) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
