"""The largest size (a batch, a sequence length) whose plan fits a target, in a few compiles."""

import dataclasses
import math
from collections.abc import Callable

from .. import _arguments as arguments
from .plans import Plan
from .table import format_bytes


# `longest`'s default compile budget: the bar a context search is held to (issue 44).
MAX_COMPILES = 8


@dataclasses.dataclass(frozen=True)
class Longest:
    """The largest size whose plan fits, from [`eqx_lean.memory.longest`][] (or
    [`eqx_lean.hf.longest_context`][] for a sequence length); `print` it.

    **Attributes:**

    - `size`: the largest multiple of the search's `multiple` known to fit (0 if none does).
    - `bound`: the smallest size known not to fit (`None` if every size up to the search's
        `maximum` fits). `bound - size == multiple` when the search closed its bracket; a
        search stopped by its compile budget says where the answer lies.
    - `plan`: the [`eqx_lean.memory.Plan`][] at `size` (at the smallest size tried if none
        fits).
    - `compiles`: the programs compiled to find it.
    - `tried`: `(size, bytes needed, fits)` of each compile, in order.
    """

    size: int
    bound: int | None
    plan: Plan
    compiles: int
    tried: tuple[tuple[int, int, bool], ...]

    def table(self) -> str:
        """The search as text: the answer and every compile."""
        tried = ", ".join(
            f"{size:,} {'fits' if fits else 'does not'} ({format_bytes(needed)})"
            for size, needed, fits in self.tried
        )
        beyond = "" if self.bound is None else f", {self.bound:,} does not"
        return (
            f"largest that fits: {self.size:,}{beyond} ({self.compiles} compiles: {tried})\n"
            + self.plan.table()
        )

    def __str__(self) -> str:
        return self.table()


def _boundary(points: list[tuple[int, int]], memory: int) -> float:
    """Where the line through two `(size, bytes)` points reaches `memory` (infinite if flat)."""
    (a, p_a), (b, p_b) = points
    slope = (p_b - p_a) / (b - a)
    return math.inf if slope <= 0 else b + (memory - p_b) / slope


def search(
    plan_at: Callable[[int], Plan],
    multiple: int,
    maximum: int,
    first: int,
    max_compiles: int | None,
) -> Longest:
    """The largest multiple of `multiple` up to `maximum` whose plan fits, and whose next
    multiple does not (the bytes need not be monotone in the size, so this is the first such
    boundary the search meets).

    The first two compiles are at `first` and twice it (or, where `first` does not fit, at
    `multiple`), fitting the bytes needed as a line in the size. Until a size is known not to
    fit, each further compile is where the line through the last two meets the memory; then
    where the line through the bracket's ends does (false position), kept inside the bracket
    of what is known to fit and not to: where the bytes are affine, the first boundary fits
    and its next multiple does not, 4 compiles in all. Where two compiles in a row did not
    halve the bracket, one bisects it. With `max_compiles`, the search stops there, its
    bracket open.
    """
    plans: dict[int, Plan] = {}
    tried: list[tuple[int, int, bool]] = []

    def at(size: int) -> bool:
        if size not in plans:
            result = plan_at(size)
            plans[size] = result
            tried.append((size, result.needed, result.fits))
        return plans[size].fits

    def down(size: float) -> int:
        return int(size // multiple) * multiple

    top = down(maximum)

    def done(lo: int, hi: int) -> Longest:
        shown = plans[lo] if lo else plans[min(plans)]
        return Longest(lo, hi if hi <= top else None, shown, len(plans), tuple(tried))

    first = min(max(multiple, down(first)), top)
    if at(first):
        lo, hi = first, top + multiple  # lo fits; hi does not (or lies beyond `maximum`)
        second = min(2 * first, top)
        if second != first:
            if at(second):
                lo = second
            else:
                hi = second
    elif first == multiple or not at(multiple):
        return done(0, multiple)
    else:
        lo, hi = multiple, first
    memory = plans[lo].device_memory
    widths = [hi - lo]
    # The bracket's ends as false position weighs them: bytes needed less the memory. An end
    # kept twice in a row has its weight halved (the Illinois rule), so that a kink in the
    # bytes (XLA changing its plan with the size) cannot hold the other end in place.
    excess: dict[int, float] = {size: plan.needed - memory for size, plan in plans.items()}
    kept: str | None = None
    while hi - lo > multiple and (max_compiles is None or len(plans) < max_compiles):
        if hi > top:
            # Nothing known not to fit yet: extrapolate the line through the last two compiles.
            (a, needed_a, _), (b, needed_b, _) = tried[-2:]
            boundary = _boundary([(a, needed_a), (b, needed_b)], memory)
        elif len(widths) >= 3 and widths[-1] > widths[-3] / 2:
            # Two compiles in a row did not halve the bracket: bisect.
            boundary = lo + (hi - lo) / 2
            # Counted twice, so that the next test sets the bisection's result against the
            # width before it, not against the width two compiles back.
            widths.append(widths[-1])
        else:
            # False position: where the line through the bracket's ends meets the memory.
            below, above = -excess[lo], excess[hi]
            boundary = lo + (hi - lo) * below / (below + above) if below + above > 0 else lo
        guess = top if math.isinf(boundary) else down(boundary)
        candidate = max(lo + multiple, min(guess, hi - multiple, top))
        if at(candidate):
            lo, moved = candidate, "lo"
        else:
            hi, moved = candidate, "hi"
        excess[candidate] = plans[candidate].needed - memory
        if hi <= top and kept == ("hi" if moved == "lo" else "lo"):
            other = hi if moved == "lo" else lo
            excess[other] /= 2
        kept = "hi" if moved == "lo" else "lo"
        widths.append(hi - lo)
    return done(lo, hi)


def longest(
    plan_at: Callable[[int], Plan],
    *,
    maximum: int,
    multiple: int = 1,
    first: int | None = None,
    max_compiles: int | None = MAX_COMPILES,
) -> Longest:
    """The largest size whose plan fits its target: a batch, a sequence length, any size a
    program is planned at.

    ```python
    def plan_at(seq_len):
        return eqx_lean.hf.plan_lora_step(config, "h100", batch_size=1, seq_len=seq_len)

    found = eqx_lean.memory.longest(plan_at, maximum=16_384, multiple=1024, first=8192)
    print(found)  # found.size, found.plan
    ```

    The search fits the bytes the plan needs ([`Plan.needed`][eqx_lean.memory.Plan.needed])
    as a line in the size from two compiles (at `first` and twice it), then compiles at the
    boundary of the line through the last two (a secant) inside the bracket of sizes known
    to fit and not to, until a size fits and the next multiple does not: 4 compiles where the
    bytes are affine in the size (as for a fixed program shape they nearly are), a few more
    where XLA's fusions change with it. A bracket that two compiles did not halve is bisected.

    **Arguments:**

    - `plan_at`: `size -> Plan`, such as a `functools.partial` of
        [`eqx_lean.hf.plan_lora_step`][] or [`eqx_lean.memory.plan_train_step`][].
    - `maximum`: the largest size to consider.
    - `multiple`: sizes are multiples of it (the search's step; the answer is exact to it).
    - `first`: the first size planned (a multiple of `multiple`); default `multiple`. A size
        near the answer's order of magnitude saves compiles; one that does not fit is fine.
    - `max_compiles`: stop after this many compiles (default 8), the answer then within
        `[size, bound)`; `None` for no limit.

    **Returns:**

    A [`eqx_lean.memory.Longest`][]; `print` it for the search.
    """
    if not callable(plan_at):
        raise TypeError(f"`plan_at` must be callable `size -> Plan`; got {plan_at!r}.")
    multiple = arguments.integer(multiple, "`multiple`", minimum=1)
    maximum = arguments.integer(maximum, "`maximum`", minimum=multiple)
    first = multiple if first is None else arguments.integer(first, "`first`", minimum=1)
    if first % multiple:
        raise ValueError(f"`first` must be a multiple of `multiple` ({multiple}); got {first}.")
    if max_compiles is not None:
        max_compiles = arguments.integer(max_compiles, "`max_compiles`", minimum=2)
    return search(plan_at, multiple, maximum, first, max_compiles)
