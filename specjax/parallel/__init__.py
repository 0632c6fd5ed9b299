"""Tensor parallelism: `mesh` (the device mesh and the layout a model is traced under), `plan` (parameter
shardings from a model family's partition rules) and `sharded_loop` (the generate loop run over a mesh).

Mesh axes: "model" (tensor parallel, size tensor_parallel_size) and "data" (replicas: whole copies of the
model, each generating for its own slice of the batch rows, sharing nothing). `LLM` uses tensor_parallel_size
devices and one replica, as vLLM's `LLM` does; `build_mesh(tp, devices)` with more devices gives
len(devices) // tp replicas.

XLA's partitioner (GSPMD) places the collectives a layout implies (for the Llama family: one all-reduce after
each of o and down, one after the vocabulary-parallel embedding lookup, one all-gather of the logits,
`gather_vocab`). Attention runs per device under shard_map (specjax.kernels.attention), steered by the
`Layout` the model is traced under (`traced_with`).
"""
