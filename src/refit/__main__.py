"""`python -m refit`: the same as the `refit` command."""

from refit.tools.cli import main

raise SystemExit(main())
