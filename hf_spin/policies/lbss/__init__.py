"""Spin's learning-based drafter selection (LBSS): an online bandit that learns, per request, which
drafter gives the most goodput, under per-drafter batch capacities. Design note: docs/lbss.md.

- config.py: `LBSSConfig`, the knobs.
- state.py: what LBSS remembers per request (`RowState`, `Arm`) and the state its parts share.
- pricing.py: the goodput model: expected tokens, a row's seconds of a step, catch-up costs.
- schedule.py: each row's epochs and exploration chunks; what it may explore or move to.
- matching.py: rows -> drafter slots (exploration draws, exploitation matching), plain probes, catch-ups.
- lookup.py: prompt lookup's shadow drafts and per-step preemption.
- policy.py: `LBSSPolicy`, the parts wired into the `Policy` interface.
"""

from .config import LBSSConfig
from .lookup import MATCH_PRIOR
from .matching import CATCH_UP_KINDS, LAST_RESORT, NO_PLAIN, PROBE_MARGIN, linear_sum_assignment
from .policy import PRIOR_NOISE, PRIOR_ROWS, LBSSPolicy
from .pricing import DRAFT_SIZE_ELASTICITY, goodput
from .schedule import PRIOR_STEPS, Stage
from .state import PLAIN, Arm, RowState

__all__ = [
    "CATCH_UP_KINDS",
    "DRAFT_SIZE_ELASTICITY",
    "LAST_RESORT",
    "MATCH_PRIOR",
    "NO_PLAIN",
    "PLAIN",
    "PRIOR_NOISE",
    "PRIOR_ROWS",
    "PRIOR_STEPS",
    "PROBE_MARGIN",
    "Arm",
    "LBSSConfig",
    "LBSSPolicy",
    "RowState",
    "Stage",
    "goodput",
    "linear_sum_assignment",
]
