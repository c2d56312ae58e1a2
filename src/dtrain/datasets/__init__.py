"""Real data sets that ship inside installed packages (nothing is downloaded)."""

from dtrain.datasets.digits import load_digits

__all__ = ["load_digits"]
