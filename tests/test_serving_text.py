"""Text helpers of the server: stop sequences cut from a stream, incremental decoding, the criterion."""

import torch

from hf_spin.serving.text import IncrementalDecoder, StopSequences, StopTrimmer, first_stop

from .tiny_tokenizers import bpe_tokenizer, char_tokenizer


def test_stop_trimmer_holds_back_what_could_start_a_stop():
    t = StopTrimmer(["\n\n", "END"])
    assert t.push("a\n") == "a"  # "\n" may begin "\n\n"
    assert t.push("b E") == "\nb "  # it did not; "E" may begin "END"
    assert t.push("N") == ""
    assert t.push("Dx") == "" and t.stopped  # "END": cut, nothing after it
    assert t.flush() == ""
    t = StopTrimmer(["\n\n"])
    assert t.push("x\n") == "x" and t.flush() == "\n"  # the stream ended first: the held text is returned
    assert StopTrimmer([]).push("any\n") == "any\n"
    assert first_stop("abcab", ["ca", "b"]) == 1


def test_incremental_decoder_concatenates_to_the_full_text():
    tok = bpe_tokenizer()
    prompt = tok("The quick brown")["input_ids"]
    text = " fox jumps over the lazy dog. She sells sea shells!"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    decoder = IncrementalDecoder(tok, prompt)
    pieces = [decoder.push(t) for t in ids]
    assert "".join(pieces) == tok.decode(prompt + ids)[len(tok.decode(prompt)) :]


def test_stop_sequences_criterion_reads_only_generated_text():
    tok = char_tokenizer()
    prompt = tok("stop here")["input_ids"]
    criterion = StopSequences(tok, ["here", "!"], prompt_length=len(prompt))
    row = lambda s: torch.tensor([prompt + tok(s, add_special_tokens=False)["input_ids"]])  # noqa: E731
    assert not criterion(row("abc"), None)[0]  # "here" is in the prompt only
    assert criterion(row("abc!"), None)[0] and criterion(row("then here"), None)[0]
