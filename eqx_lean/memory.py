"""Memory estimates, measurements and live-array reports (`eqx_lean.memory`)."""

from ._memory import (
    Fit as Fit,
    FitResult as FitResult,
    LeafInfo as LeafInfo,
    LeafReport as LeafReport,
    LiveArrayGroup as LiveArrayGroup,
    LiveArrayReport as LiveArrayReport,
    Measurement as Measurement,
    MemoryEstimate as MemoryEstimate,
    Plan as Plan,
    Target as Target,
    describe as describe,
    estimate as estimate,
    fit as fit,
    live_arrays as live_arrays,
    measure as measure,
    plan as plan,
    plan_train_step as plan_train_step,
    target as target,
)
