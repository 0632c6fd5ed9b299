"""Training conversations with the target's hidden states, stored on disk ragged (no padding), float16:

    DIR/meta.json          num_examples, hidden_size, aux_layer_ids, capacity
    DIR/tokens.npy         int32 [total]            every conversation's tokens, concatenated
    DIR/offsets.npy        int64 [N + 1]            conversation n is tokens[offsets[n]:offsets[n+1]]
    DIR/prompt_lengths.npy int32 [N]
    DIR/aux.npy            float16 [capacity, n*H]  residual stream entering each aux layer (EAGLE-3's input)
    DIR/final.npy          float16 [capacity, H]    final-normed hidden state (the target's logits come from it)

The feature files are preallocated memmaps; meta.json is rewritten after each flush, so a long recording
resumes from the last flushed conversation.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Sequence

import numpy as np

FLOAT16_MAX = 65504.0


@dataclasses.dataclass
class FeatureStore:
    tokens: np.ndarray
    offsets: np.ndarray
    prompt_lengths: np.ndarray
    aux: np.ndarray
    final: np.ndarray
    aux_layer_ids: tuple[int, ...]

    @property
    def num_examples(self) -> int:
        return len(self.prompt_lengths)

    def length(self, n: int) -> int:
        return int(self.offsets[n + 1] - self.offsets[n])

    def response_tokens(self) -> np.ndarray:
        """Every response token, concatenated (for the draft vocabulary)."""
        return np.concatenate([self.tokens[self.offsets[n] + self.prompt_lengths[n]:self.offsets[n + 1]]
                               for n in range(self.num_examples)] or [np.zeros(0, np.int32)])


class FeatureWriter:
    """Appends conversations to a store directory, reopening what an earlier run flushed."""

    def __init__(self, path: str | Path, capacity: int, hidden_size: int, aux_layer_ids: Sequence[int]):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.meta = {"hidden_size": hidden_size, "aux_layer_ids": list(aux_layer_ids), "capacity": capacity}
        width = len(aux_layer_ids) * hidden_size
        existing = self._existing()
        capacity = self.meta["capacity"]
        mode = "r+" if existing else "w+"
        self.aux = np.lib.format.open_memmap(self.path / "aux.npy", mode, np.float16, (capacity, width))
        self.final = np.lib.format.open_memmap(self.path / "final.npy", mode, np.float16, (capacity, hidden_size))
        self.tokens: list[np.ndarray] = []
        self.offsets, self.prompt_lengths = [0], []
        if existing:
            store = open_features(self.path)
            self.tokens = [store.tokens]
            self.offsets, self.prompt_lengths = store.offsets.tolist(), store.prompt_lengths.tolist()

    @property
    def num_examples(self) -> int:
        return len(self.prompt_lengths)

    def append(self, tokens: np.ndarray, prompt_length: int, aux: np.ndarray, final: np.ndarray) -> None:
        begin, end = self.offsets[-1], self.offsets[-1] + len(tokens)
        if end > self.meta["capacity"]:
            raise ValueError(f"the feature store in {self.path} is full ({self.meta['capacity']} tokens); "
                             "record fewer conversations or a larger capacity")
        self.aux[begin:end] = np.clip(aux, -FLOAT16_MAX, FLOAT16_MAX)
        self.final[begin:end] = final
        self.tokens.append(np.asarray(tokens, np.int32))
        self.offsets.append(end)
        self.prompt_lengths.append(int(prompt_length))

    def flush(self) -> None:
        self.aux.flush()
        self.final.flush()
        np.save(self.path / "tokens.npy", np.concatenate(self.tokens or [np.zeros(0, np.int32)]))
        np.save(self.path / "offsets.npy", np.asarray(self.offsets, np.int64))
        np.save(self.path / "prompt_lengths.npy", np.asarray(self.prompt_lengths, np.int32))
        (self.path / "meta.json").write_text(json.dumps({**self.meta, "num_examples": self.num_examples}))

    def _existing(self) -> bool:
        meta_file = self.path / "meta.json"
        if not meta_file.is_file():
            return False
        meta = json.loads(meta_file.read_text())
        if any(meta.get(k) != self.meta[k] for k in ("hidden_size", "aux_layer_ids")):
            raise ValueError(f"{self.path} holds features of another target or aux layers ({meta}); use a new "
                             "directory")
        self.meta["capacity"] = meta["capacity"]   # the files keep the size they were made with
        return True


def open_features(path: str | Path) -> FeatureStore:
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{meta_file} does not exist: {path} holds no recorded target features")
    meta = json.loads(meta_file.read_text())
    return FeatureStore(tokens=np.load(path / "tokens.npy"), offsets=np.load(path / "offsets.npy"),
                        prompt_lengths=np.load(path / "prompt_lengths.npy"),
                        aux=np.load(path / "aux.npy", mmap_mode="r"), final=np.load(path / "final.npy", mmap_mode="r"),
                        aux_layer_ids=tuple(meta["aux_layer_ids"]))
