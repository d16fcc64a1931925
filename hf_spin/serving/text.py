"""From token ids to text and back: stop sequences, incremental detokenization, finish reasons.

`StopSequences` is a stopping criterion over the decoded text (TGI's semantics: generation stops once
the generated text contains a stop sequence, and the text keeps it). It decodes only the last few
tokens at each call, so its cost does not grow with the row.

`IncrementalDecoder` turns one token at a time into the text it adds (TGI's `decode_token`): it decodes
a short window before the new token and holds text back while the window ends inside a multi-byte
character, so a stream's texts concatenate to the full text.
"""

from __future__ import annotations

import torch
from transformers import StoppingCriteria

from ..step.rows import CANCELLED, ERROR, LENGTH, Row

# Tokens decoded beyond the longest stop sequence's length in characters: a stop sequence can straddle
# tokens that decode to nothing on their own (a split multi-byte character, a special token).
STOP_WINDOW_MARGIN = 8
# Prompt tokens an incremental decoder starts from: enough context for tokenizers that decode a token
# differently at the start of a text (SentencePiece's leading space).
DECODE_CONTEXT = 5


class StopSequences(StoppingCriteria):
    """Stops a row whose generated text contains one of `stops` (checked after every token)."""

    def __init__(self, tokenizer, stops: list[str], prompt_length: int):
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.prompt_length = prompt_length  # [1, prompt + generated] rows without padding (server rows)
        self.window = max(len(s) for s in stops) + STOP_WINDOW_MARGIN

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        generated = input_ids[0, self.prompt_length :][-self.window :].tolist()
        text = self.tokenizer.decode(generated, skip_special_tokens=False)
        return torch.tensor([any(s in text for s in self.stops)], device=input_ids.device)


def first_stop(text: str, stops: list[str]) -> int | None:
    """Index in `text` where the earliest stop sequence starts, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


class IncrementalDecoder:
    """push(token) -> the text that token adds ("" while a character is incomplete)."""

    def __init__(self, tokenizer, prompt: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt[-DECODE_CONTEXT:])
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] is the context already emitted
        self.read_offset = len(self.ids)

    def push(self, token: int) -> str:
        self.ids.append(token)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=False)
        text = decode(self.ids[self.prefix_offset :], skip_special_tokens=False)
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            new = text[len(prefix) :]
            # keep ids from the emitted context on: the list stays short however long the row gets
            self.ids = self.ids[self.read_offset :] if self.read_offset > 0 else self.ids
            self.prefix_offset, self.read_offset = 0, len(self.ids)
            return new
        return ""


def finish_reason(row: Row, eos_ids: set[int]) -> str:
    """TGI's finish reason of a finished row: "length", "eos_token", "stop_sequence" (or hf_spin's
    "cancelled", "error")."""
    if row.finish_reason in (LENGTH, CANCELLED, ERROR):
        return row.finish_reason
    if row.generated and row.generated[-1] in eos_ids:
        return "eos_token"
    return "stop_sequence"


class StopTrimmer:
    """Cuts streamed text at the first stop sequence (OpenAI's semantics: the stop is not returned),
    holding back a tail that could be the beginning of one.

    Example, stops ["\\n\\n"]: push("a\\n") -> "a" (holds "\\n"), push("\\nb") -> "" and stops; flush() -> "".
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.buffer = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self.buffer += text
        hit = first_stop(self.buffer, self.stops)
        if hit is not None:
            out, self.buffer, self.stopped = self.buffer[:hit], "", True
            return out
        held = max((k for s in self.stops for k in range(1, len(s)) if self.buffer.endswith(s[:k])), default=0)
        cut = len(self.buffer) - held
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out

    def flush(self) -> str:
        out, self.buffer = ("" if self.stopped else self.buffer), ""
        return out
