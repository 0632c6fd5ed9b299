"""Hot-path kernels: Pallas kernels for NVIDIA GPUs, each with a pure-JAX reference of the same
signature and a dispatcher that picks between them (e.g. `specjax.kernels.attention.attention`).

Names are not re-exported here: a function named like its module would shadow the module.
"""
