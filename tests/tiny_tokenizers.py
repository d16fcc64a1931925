"""Small, different tokenizers built offline with the `tokenizers` library, for token-translation tests.

    char_tokenizer()     one token per character: <pad> <s> </s> <unk> then 92 printable ASCII characters,
                         96 ids in all (= archs.VOCAB, and ids 0, 1, 2 = archs.PAD, BOS, EOS). No merges,
                         no special tokens added on encode: ids map 1:1 to characters.
    char_tokenizer(reverse=True)
                         the same characters with the 92 character ids in reverse order: a tokenizer that
                         segments text exactly like the first one but whose vocabulary differs, so the
                         pool translates through text instead of sharing ids.
    bpe_tokenizer()      a BPE with Metaspace word boundaries trained in memory on TEXT (about 160 ids),
                         that prepends <s>: other ids, other segmentation, other length.

Every character the char tokenizer knows is in the BPE's initial alphabet, so any target text can be
encoded by the drafter and back.
"""

from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3, the first three = archs.PAD, BOS, EOS
# Printable ASCII (95 characters) without three rare ones, so specials + characters = 96 ids.
ALPHABET = [chr(c) for c in range(32, 127) if chr(c) not in "`^~"]

TEXT = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs into the woods.
A small model drafts a few tokens; the large model checks them all at once and keeps the ones it agrees with.
When the draft is right, decoding is faster. When it is wrong, nothing is lost: the output is the same.
She sells sea shells by the sea shore. Peter Piper picked a peck of pickled peppers.
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness.
In the beginning the sky was clear and the sea was calm; then the wind rose and the rain came down.
Numbers like 1, 2, 3 and 42 appear in text too, as do words such as (this), [that] and {other}!
"""

# Prompts for the translating drafter: real text, 10-16 characters (= target tokens) each.
PROMPTS = ["a small model", "the sea was", "the quick brown", "it was the best"]


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="left",
    )


@functools.lru_cache(maxsize=None)
def char_tokenizer(reverse: bool = False) -> PreTrainedTokenizerFast:
    chars = ALPHABET[::-1] if reverse else ALPHABET
    vocab = {token: i for i, token in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one id per character
    tok.add_special_tokens(SPECIALS)
    tok.decoder = decoders.Fuse()  # concatenate characters, no separator
    return _wrap(tok)


@functools.lru_cache(maxsize=None)
def bpe_tokenizer(vocab_size: int = 160) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=ALPHABET, show_progress=False
    )
    tok.train_from_iterator(TEXT.splitlines(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", SPECIALS.index("<s>"))])
    return _wrap(tok)
