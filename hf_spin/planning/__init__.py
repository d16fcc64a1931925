"""Planning: how much of each draft a step pays for, from what forwards cost on this machine (docs/planning.md).

`machine`: which machine this is; `cost_profile`: measured forward seconds by rows x new tokens,
refined online; `grid`: measures a model's forward cost; `profiling`: caches a model's profile;
`acceptance`: what each drafter's drafts survive, per position; `estimates`: the online estimators
(decayed means, the verification fit, the cost model policies read); `planner`: sizes every step's
drafts (k per row, 0 allowed) and trims them to what pays to verify.
"""
