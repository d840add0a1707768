"""The incremental detokenizer: its Rust path (``tokenizers``' DecodeStream) gives exactly the pieces of
the window algorithm decoded in Python with ``tokenizer.decode`` (the reference below, which the worker
used before), on random token sequences of several tokenizer kinds."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from benchmarks.template_zoo import load_zoo, zoo_format
from worker.detokenizer import IncrementalDetokenizer, rust_backend

TEXT = (
    "The keeper climbed the stairs again, counted 112 steps — naïve café, Ünïcödé, 你好世界, こんにちは, "
    "🙂🚀👩‍👩‍👧 and \t tabs\n\nnew lines; it's don't \"quoted\" (x+y)=z {json: [1, 2]} <tag> ##hash ▁x"
)
# not in the trained tokenizers' corpus: byte fallback
UNSEEN = " Ωμέγα ελληνικά, עברית, हिन्दी, \U0001d518\U0001d52b \u27e8\u2200x\u2208\u211d\u27e9"


class Reference:
    """The window algorithm with two ``tokenizer.decode`` calls per token (the old implementation)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok, self.ids, self.prefix_offset, self.read_offset, self.text = tokenizer, [], 0, 0, ""

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        full = self.decode(self.ids[self.prefix_offset :])
        prefix = self.decode(self.ids[self.prefix_offset : self.read_offset])
        delta = full[len(prefix) :] if full.startswith(prefix) else ""
        self.text += delta
        return delta


def sequences(tok: Any, rng: random.Random, n: int) -> list[list[int]]:
    """Random id sequences: uniform over the vocabulary (special and byte tokens included), encoded
    multilingual text cut anywhere, and text with random tokens spliced in."""
    vocab = len(tok)
    text_ids = tok.encode(TEXT + UNSEEN, add_special_tokens=False)
    specials = list(tok.all_special_ids)
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            seq = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        elif kind == 1:
            a = rng.randrange(len(text_ids))
            seq = text_ids[a : a + rng.randint(1, 60)]
        else:
            seq = list(text_ids[: rng.randint(1, len(text_ids))])
            for _ in range(rng.randint(1, 6)):
                seq.insert(
                    rng.randrange(len(seq) + 1),
                    rng.choice(specials or [0]) if rng.random() < 0.5 else rng.randrange(vocab),
                )
        out.append(seq)
    return out


def check_same_pieces(tok: Any, n: int = 300, seed: int = 0) -> None:
    assert rust_backend(tok) is not None, "expected the Rust path for this tokenizer"
    rng = random.Random(seed)
    for seq in sequences(tok, rng, n):
        ours, ref = IncrementalDetokenizer(tok), Reference(tok)
        assert [ours.add(t) for t in seq] == [ref.add(t) for t in seq], seq
        assert ours.flush() == ref.flush(), seq
        assert ours.text == ref.text, seq


def test_tiny_byte_level_bpe(tiny_model_dir: Path) -> None:
    check_same_pieces(AutoTokenizer.from_pretrained(str(tiny_model_dir)), n=600)


@pytest.mark.parametrize("name", ["Qwen-Qwen3-0.6B", "meta-llama-Llama-3.1-8B-Instruct", "google-gemma-2-2b-it"])
def test_real_vocabularies(name: str) -> None:
    """The template zoo's tokenizers (these models' special and added tokens), built here when not cached
    yet: on a fresh machine this file runs before the template tests that used to build them."""
    template = next((t for t in load_zoo() if t.name == name), None)
    assert template is not None, f"no template {name} in the zoo"
    check_same_pieces(zoo_format(template).tokenizer, n=300)


def _trained(kind: str) -> PreTrainedTokenizerFast:
    """Small tokenizers of other decoder kinds, trained here: SentencePiece-style BPE with byte
    fallback (Llama 2, Gemma) and WordPiece (BERT)."""
    corpus = [TEXT, TEXT.upper(), "hello world, hello there. " * 20, "ça va? très bien! 你好吗 🙂"] * 5
    if kind == "sentencepiece":
        tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        bytes_ = [f"<0x{b:02X}>" for b in range(256)]
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *bytes_])
    else:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=False)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
        trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=["[UNK]", "[CLS]", "[SEP]"])
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)
    fast.add_special_tokens({"eos_token": "</s>" if kind == "sentencepiece" else "[SEP]"})
    return fast


@pytest.mark.parametrize("kind", ["sentencepiece", "wordpiece"])
def test_other_decoder_kinds(kind: str) -> None:
    check_same_pieces(_trained(kind), n=400)


def test_a_tokenizer_that_cleans_up_decodes_in_python() -> None:
    """transformers' clean-up pass (WordPiece with clean_up_tokenization_spaces) is not in Rust's decode:
    such a tokenizer takes the Python path, whose pieces are the reference's by construction."""
    tok = _trained("wordpiece")
    tok.clean_up_tokenization_spaces = True
    assert rust_backend(tok) is None
    for seq in sequences(tok, random.Random(1), 50):
        ours, ref = IncrementalDetokenizer(tok), Reference(tok)
        assert [ours.add(t) for t in seq] == [ref.add(t) for t in seq]
        assert ours.flush() == ref.flush()


def test_a_character_split_across_tokens_comes_with_its_last_byte(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = tok.encode("a🙂b", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == "a🙂b" and "🙂" in pieces and all("\ufffd" not in p for p in pieces)
    unfinished = IncrementalDetokenizer(tok)
    cut = tok.encode("🙂", add_special_tokens=False)[:-1]
    assert [unfinished.add(t) for t in cut] == [""] * len(cut)
    assert unfinished.flush() == tok.decode(cut) and unfinished.text == tok.decode(cut)


def test_when_the_rust_window_fails_python_goes_on_from_the_same_window(tiny_model_dir: Path) -> None:
    """DecodeStream refuses a window whose text does not extend what it gave before; the detokenizer
    then carries on in Python from the same window, exactly as the reference does."""

    class Failing:
        def step(self, tokenizer: Any, token_id: int) -> str | None:
            raise RuntimeError("Invalid prefix encountered")

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = tok.encode(TEXT, add_special_tokens=False)
    for cut in (1, 7, len(ids) // 2):
        ours, ref = IncrementalDetokenizer(tok), Reference(tok)
        head = [ours.add(t) for t in ids[:cut]]
        assert head == [ref.add(t) for t in ids[:cut]]
        ours._stream = Failing()
        assert [ours.add(t) for t in ids[cut:]] == [ref.add(t) for t in ids[cut:]]
        assert ours._stream is None and ours.flush() == ref.flush() and ours.text == ref.text == TEXT
