"""`python -m dtrain.demo [FLAGS]`: the demo's training script, as `dtrain demo` runs it
in every worker."""

import sys

from dtrain.demo.script import main

main(sys.argv[1:])
