"""Training EAGLE-3 draft heads in JAX: `python -m specjax.training --help`."""
