"""Draft proposers: each returns drafts [B, k] int32 (-1 = no draft) for the verify step."""

from specjax.engine.proposers.ngram import propose_ngram

__all__ = ["propose_ngram"]
