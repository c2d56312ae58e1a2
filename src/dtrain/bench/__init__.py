"""`dtrain bench`: strategies x process counts side by side (`strategies`, with `trial`,
`table` and `plots`), and the collectives' bandwidth (`comm`)."""
