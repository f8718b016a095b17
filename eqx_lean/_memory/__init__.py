"""Memory before, while and after building: estimates, measurements and live-array reports."""

from .estimates import MemoryEstimate as MemoryEstimate, estimate as estimate
from .leaves import LeafInfo as LeafInfo, LeafReport as LeafReport, describe as describe
from .live import (
    LiveArrayGroup as LiveArrayGroup,
    LiveArrayReport as LiveArrayReport,
    live_arrays as live_arrays,
)
from .load_plans import LoadPlan as LoadPlan, plan_load as plan_load
from .measurements import Measurement as Measurement, measure as measure
from .plans import Plan as Plan, plan as plan
from .search import Longest as Longest, longest as longest
from .targets import Target as Target, target as target
from .training import (
    Fit as Fit,
    FitResult as FitResult,
    fit as fit,
    plan_train_step as plan_train_step,
)
