"""All user-facing parsing and validation, before anything loads or compiles: `engine` (`LLM(...)` settings),
`speculative` (`speculative_config`), `memory` (the KV-cache fit check), `dtypes` (the one dtype table) and
`validators` (the small checks they share)."""
from specjax.config.dtypes import canonical_dtype, resolve_dtype
from specjax.config.engine import ACCEPTED_KWARGS, NO_EFFECT_KWARGS, EngineConfig
from specjax.config.memory import check_kv_cache_fits
from specjax.config.speculative import (KNOWN_METHODS, SpeculativeConfig, check_draft_compatible,
                                        method_from_head_config)

__all__ = ["ACCEPTED_KWARGS", "KNOWN_METHODS", "NO_EFFECT_KWARGS", "EngineConfig",
           "SpeculativeConfig", "canonical_dtype", "check_draft_compatible", "check_kv_cache_fits",
           "method_from_head_config", "resolve_dtype"]
