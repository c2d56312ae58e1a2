"""Real data sets that ship inside installed packages (nothing is downloaded).

A foundation: it imports only the leaves.
"""

from dtrain.datasets.sklearn_digits import load_digits
from dtrain.datasets.text import load_text

__all__ = ["load_digits", "load_text"]
