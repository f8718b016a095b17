"""Reference models built with eqx_lean; run from the repository root."""
