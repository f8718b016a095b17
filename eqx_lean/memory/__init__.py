"""Memory estimates, measurements and live-array reports (`eqx_lean.memory`)."""

from .._memory import (
    LeafInfo as LeafInfo,
    LeafReport as LeafReport,
    LiveArrayGroup as LiveArrayGroup,
    LiveArrayReport as LiveArrayReport,
    LoadPlan as LoadPlan,
    Measurement as Measurement,
    MemoryEstimate as MemoryEstimate,
    Plan as Plan,
    Target as Target,
    describe as describe,
    estimate as estimate,
    live_arrays as live_arrays,
    measure as measure,
    plan as plan,
    plan_load as plan_load,
    target as target,
)
