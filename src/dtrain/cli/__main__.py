"""`python -m dtrain.cli ARGS`: the `dtrain` command where no console script is on the
PATH (bench trials, plan probes, ssh)."""

import sys

from dtrain.cli.commands import main

sys.exit(main())
