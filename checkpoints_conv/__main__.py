"""`python -m checkpoints_conv ...`: see checkpoints_conv.cli."""
from checkpoints_conv.cli import main

raise SystemExit(main())
