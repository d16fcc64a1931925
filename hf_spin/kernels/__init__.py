"""Triton kernels for ragged verification, each beside a pure-PyTorch reference and a dispatcher that
falls back to the reference where Triton or a GPU is missing."""

from .varlen_attention import HAS_TRITON, pack_tree_masks, use_triton, varlen_attention, varlen_attention_ref, warm_up

__all__ = ["HAS_TRITON", "pack_tree_masks", "use_triton", "varlen_attention", "varlen_attention_ref", "warm_up"]
from .torch_varlen import torch_varlen_unsupported, varlen_attention_torch  # noqa: E402

__all__ += ["torch_varlen_unsupported", "varlen_attention_torch"]
from .attention import ATTENTION_NAME, VarlenMetadata, register, varlen_attention_forward, varlen_attention_mask  # noqa: E402

__all__ += ["ATTENTION_NAME", "VarlenMetadata", "register", "varlen_attention_forward", "varlen_attention_mask"]
from .decomposition import DecompositionPlan, decomposed_attention, plan_decomposition  # noqa: E402

__all__ += ["DecompositionPlan", "decomposed_attention", "plan_decomposition"]
