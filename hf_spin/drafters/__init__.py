"""Drafter kinds: each proposes tokens in the target's vocabulary; none holds a heuristic."""

from .base import Draft, Drafter, DraftRequest
from .encoder_decoder import EncoderDecoderDrafter
from .fuzzy import FuzzyDrafter, fuzzy_device_map
from .model import ModelDrafter
from .prompt_lookup import PromptLookupDrafter
from .streaming import StreamingDrafter
from .suffix import SuffixDrafter
from .translation import TranslatingDrafter

__all__ = [
    "Draft",
    "Drafter",
    "DraftRequest",
    "EncoderDecoderDrafter",
    "FuzzyDrafter",
    "ModelDrafter",
    "PromptLookupDrafter",
    "StreamingDrafter",
    "SuffixDrafter",
    "TranslatingDrafter",
    "fuzzy_device_map",
]
