"""Draft proposers (the `Proposer` protocol in base.py): each returns drafts [B, k] int32 (-1 = no draft) for
the verify step. specjax/build.py holds the table that builds one per speculative method."""
