"""One step of speculative decoding, in the order it runs (docs/design.md, "The modules of one step").

The engine (`engine.SpinEngine`) drives it: admit joining rows (`admission`), retire finished ones,
plan (the policy and the planner: `hf_spin.policies`, `hf_spin.planning`), draft (`drafting`, over
`hf_spin.drafters`), verify (`hf_spin.verify`, `tree_step` for token trees) with the target's
processors (`processors`), commit through the stopping criteria (`stopping`). `rows` holds what a
row is; `faults` what a fault costs; `pipeline` overlaps the steps of two micro-batches.
"""
