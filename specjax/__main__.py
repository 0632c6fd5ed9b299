"""`python -m specjax ...`: the `specjax` command (see specjax.cli)."""
from specjax.cli import main

raise SystemExit(main())
