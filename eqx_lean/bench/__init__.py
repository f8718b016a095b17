"""`python -m eqx_lean.bench`: peak memory of stacked-layer construction, side by side."""
