"""`dtrain bench`: measurements run side by side (collective bandwidth, ...)."""
