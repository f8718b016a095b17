"""Memory estimates, measurements and live-array reports, and plans for GPUs and TPUs
(`eqx_lean.memory`)."""

from .._memory import (
    Fit as Fit,
    FitResult as FitResult,
    LeafInfo as LeafInfo,
    LeafReport as LeafReport,
    LiveArrayGroup as LiveArrayGroup,
    LiveArrayReport as LiveArrayReport,
    LoadPlan as LoadPlan,
    Longest as Longest,
    Measurement as Measurement,
    MemoryEstimate as MemoryEstimate,
    Plan as Plan,
    Target as Target,
    describe as describe,
    estimate as estimate,
    fit as fit,
    live_arrays as live_arrays,
    longest as longest,
    measure as measure,
    plan as plan,
    plan_load as plan_load,
    plan_train_step as plan_train_step,
    target as target,
)
