"""hf_spin: lossless speculative decoding with a pool of heterogeneous assistants for `transformers`.

    pool = hf_spin.AssistantPool([draft_model, "prompt_lookup"], policy="fixed")
    out = model.generate(**batch, custom_generate=hf_spin.generate, assistant_pool=pool, max_new_tokens=64)
    hf_spin.enable()  # from here on: model.generate(**batch, assistant_pool=pool, ...)
"""

from importlib.metadata import PackageNotFoundError, version

from . import kernels  # registers attn_implementation="hf_spin_varlen" with transformers
from .drafters import Drafter, FuzzyDrafter, ModelDrafter, PromptLookupDrafter, StreamingDrafter, TranslatingDrafter
from .generation import SpinGenerateOutput, disable, enable, generate
from .policies import DraftLength, FixedLength, FixedPolicy, Plan, Policy, RoundRobinPolicy
from .pool import AssistantPool
from .stats import GenerationStats

try:
    __version__ = version("hf-spin")
except PackageNotFoundError:  # imported from a source tree that was not installed
    __version__ = "0.0.0+local"

__all__ = [
    "AssistantPool",
    "DraftLength",
    "Drafter",
    "FixedLength",
    "FixedPolicy",
    "FuzzyDrafter",
    "GenerationStats",
    "ModelDrafter",
    "Plan",
    "Policy",
    "PromptLookupDrafter",
    "RoundRobinPolicy",
    "SpinGenerateOutput",
    "StreamingDrafter",
    "TranslatingDrafter",
    "disable",
    "enable",
    "generate",
]
