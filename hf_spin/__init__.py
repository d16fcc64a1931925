"""hf_spin: lossless speculative decoding with a pool of heterogeneous assistants for `transformers`.

    pool = hf_spin.AssistantPool([draft_model, "prompt_lookup"], policy="fixed")
    out = model.generate(**batch, custom_generate=hf_spin.generate, assistant_pool=pool, max_new_tokens=64)
    hf_spin.enable()  # from here on: model.generate(**batch, assistant_pool=pool, ...)

    engine = hf_spin.SpinEngine(model, pool)      # continuous batching: rows join and leave between steps
    row = engine.add(hf_spin.Request(prompt_ids, max_new_tokens=64)); engine.step() ...
"""

from importlib.metadata import PackageNotFoundError, version

from . import kernels  # registers attn_implementation="hf_spin_varlen" with transformers
from .drafters import Drafter, FuzzyDrafter, ModelDrafter, PromptLookupDrafter, StreamingDrafter, SuffixDrafter, TranslatingDrafter
from .engine import SpinEngine
from .generation import SpinGenerateOutput, disable, enable, generate
from .pipeline import Pipeline
from .policies import DraftLength, FixedLength, FixedPolicy, Plan, Policy, RoundRobinPolicy
from .pool import AssistantPool
from .rows import Request, Row
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
    "Pipeline",
    "Plan",
    "Policy",
    "PromptLookupDrafter",
    "Request",
    "RoundRobinPolicy",
    "Row",
    "SpinEngine",
    "SpinGenerateOutput",
    "StreamingDrafter",
    "SuffixDrafter",
    "TranslatingDrafter",
    "disable",
    "enable",
    "generate",
]
