"""Verification: what a target's scores accept of a draft, losslessly (docs/design.md, step 5).

`chains`: greedy and rejection-sampled verification of one chain per row; `token_tree`: a draft as a
tree of candidates; `trees`: the greedy walk and multi-candidate rejection sampling of a tree;
`vote_tree`: several drafters' drafts merged into one weighted tree. Nothing here runs a model:
`hf_spin.step` feeds the target and hands its scores in.
"""
