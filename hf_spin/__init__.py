"""hf_spin: lossless speculative decoding with a pool of heterogeneous assistants for `transformers`.

pool = hf_spin.AssistantPool([draft_model, "prompt_lookup"], policy="fixed")
out = model.generate(**batch, custom_generate=hf_spin.generate, assistant_pool=pool, max_new_tokens=64)
hf_spin.enable()  # from here on: model.generate(**batch, assistant_pool=pool, ...)

engine = hf_spin.SpinEngine(model, pool)      # continuous batching: rows join and leave between steps
row = engine.add(hf_spin.Request(prompt_ids, max_new_tokens=64)); engine.step() ...
"""

from . import kernels  # noqa: F401  (registers attn_implementation="hf_spin_varlen" with transformers
from .drafters import (
    Drafter,
    EncoderDecoderDrafter,
    FuzzyDrafter,
    ModelDrafter,
    PromptLookupDrafter,
    StreamingDrafter,
    SuffixDrafter,
    TranslatingDrafter,
)
from .generation import SpinGenerateOutput, disable, enable, generate
from .heap import freeze_gc
from .policies import DraftLength, FixedLength, FixedPolicy, Plan, Policy, RoundRobinPolicy
from .pool import AssistantPool
from .stats import GenerationStats
from .step.engine import SpinEngine
from .step.pipeline import Pipeline
from .step.rows import Request, Row
from .version import __version__

__all__ = [
    "__version__",
    "AssistantPool",
    "DraftLength",
    "Drafter",
    "EncoderDecoderDrafter",
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
    "freeze_gc",
    "generate",
]
