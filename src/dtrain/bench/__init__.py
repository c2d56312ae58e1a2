"""`dtrain bench`: strategies x process counts side by side (`strategies`, with `trial`,
`table` and `plots`), and the collectives' bandwidth (`comm`).

A product: it enters the core through the public API and a few named doors (the
strategy specs, the launcher's hosts, the observers' metrics and progress, the models'
recipes, batches); nothing in the core imports it but the command line.
"""
