"""Ready-made dtype rules for every `dtype=` argument (`eqx_lean.dtypes`)."""

from ._core import for_modules as for_modules, for_vectors as for_vectors
