"""`python -m refit`: the same as the `refit` command."""

from refit.cli import main

raise SystemExit(main())
