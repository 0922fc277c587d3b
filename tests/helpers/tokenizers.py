"""Small trained tokenizers of the families text is packed with, built offline in a second."""

from __future__ import annotations

import functools

import numpy as np

WORDS = ("the cat sat on a mat dog ran über naïve 日本語 café 1234 3.14 don't it's (x) [y] "
         "foo_bar <|endoftext|> 1999 42").split()
# GPT-4's pre-tokenizer: digits three by three from a run's start, a letter run's one leading
# non-letter with it
GPT4 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
        r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def sample_text(n: int, seed: int = 0) -> str:
    """About n words of WORDS with sentence ends, lines and paragraphs."""
    rng = np.random.default_rng(seed)
    seps = rng.choice([" ", " ", " ", ". ", "\n", "\n\n", "  ", "\t"], n)
    return "".join(w + s for w, s in zip(rng.choice(WORDS, n).tolist(), seps.tolist()))


def _trained(tok, trainer):
    tok.train_from_iterator(sample_text(20_000).splitlines(), trainer)
    return tok


@functools.cache
def families() -> dict:
    """name -> Tokenizer: GPT-2's byte-level BPE; GPT-4's (its split, BOS); Llama 2's BPE over
    the whole text (no pre-tokenizer, spaces as "▁", byte fallback, BOS); BERT's WordPiece
    ([CLS] ... [SEP]); T5's Unigram (Metaspace, EOS); a BPE over Metaspace with "▁" prepended
    to the first piece only."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    def template(tok, single, *names):
        tok.post_processor = processors.TemplateProcessing(
            single=single, special_tokens=[(n, tok.token_to_id(n)) for n in names])
        return tok

    gpt2 = Tokenizer(models.BPE())
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    gpt2.decoder = decoders.ByteLevel()
    _trained(gpt2, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                       special_tokens=["<|endoftext|>"],
                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    gpt4 = Tokenizer(models.BPE())
    gpt4.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GPT4), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    _trained(gpt4, trainers.BpeTrainer(vocab_size=500, show_progress=False,
                                       special_tokens=["<|bos|>"],
                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    llama = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    llama.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                             normalizers.Replace(" ", "▁")])
    _trained(llama, trainers.BpeTrainer(
        vocab_size=500, show_progress=False,
        special_tokens=["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]))
    bert = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    bert.normalizer = normalizers.BertNormalizer(lowercase=True)
    bert.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    _trained(bert, trainers.WordPieceTrainer(vocab_size=300, show_progress=False,
                                             special_tokens=["[UNK]", "[CLS]", "[SEP]"]))
    t5 = Tokenizer(models.Unigram())
    t5.normalizer = normalizers.Sequence([  # SentencePiece's nmt_nfkc: whitespace to a space
        normalizers.NFKC(), normalizers.Replace(Regex(r"\s"), " ")])
    t5.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    _trained(t5, trainers.UnigramTrainer(vocab_size=200, show_progress=False, unk_token="<unk>",
                                         special_tokens=["<pad>", "</s>", "<unk>"]))
    bare = Tokenizer(models.Unigram())  # no pre-tokenizer: the text is one "word"
    _trained(bare, trainers.UnigramTrainer(vocab_size=200, show_progress=False,
                                           unk_token="<unk>", special_tokens=["<unk>"]))
    first = Tokenizer(models.BPE(unk_token="<unk>"))
    first.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    _trained(first, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                        special_tokens=["<unk>"]))
    return {"gpt2_bytes": gpt2, "gpt4_split": template(gpt4, "<|bos|> $A", "<|bos|>"),
            "llama_bpe": template(llama, "<s> $A", "<s>"),
            "bert_wordpiece": template(bert, "[CLS] $A [SEP]", "[CLS]", "[SEP]"),
            "t5_unigram": template(t5, "$A </s>", "</s>"), "metaspace_first": first,
            "unigram_bare": bare}
