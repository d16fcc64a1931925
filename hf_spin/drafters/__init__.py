"""Drafter kinds: each proposes tokens in the target's vocabulary; none holds a heuristic."""

from .base import Draft, Drafter, DraftRequest
from .model import ModelDrafter
from .prompt_lookup import PromptLookupDrafter
from .translation import TranslatingDrafter

__all__ = ["Draft", "Drafter", "DraftRequest", "ModelDrafter", "PromptLookupDrafter", "TranslatingDrafter"]
