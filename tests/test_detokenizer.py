"""Tests for shared.engine.detokenizer.IncrementalDetokenizer.

The tokenizer is a small byte-level BPE trained here on a few lines of text, so
that common words are single tokens while rarer characters (some accented
letters, CJK, emoji) are split into several byte tokens.
"""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from shared.engine.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"
EOS = "<|endoftext|>"
IM_START = "<|im_start|>"

CORPUS = [
    "say hello world, hello world again and again",
    "hello world hello world hello there",
    "the quick brown fox jumps over the lazy dog",
    "café crème brûlée à la carte, naïve façade, señor",
    "日本語のテキストです。東京は日本の首都です。",
    "中文文本测试，你好世界，你好世界",
    "emoji time 😀 😀 😀 smile 😀 party 🎉 🎉",
    "numbers 0123456789 and symbols !?.,;:-()[]{}",
]

# Characters for random valid text: ASCII, ones that appear in the corpus, and
# ones that do not (so they are certainly split into byte tokens).
ALPHABET = list("abcdefghijklmnopqrstuvwxyz      ,.!?") + list("éèàçñüßøœ日本語中文你好世界東京") + [
    "😀",
    "🎉",
    "🦀",
    "🚀",
    "€",
    "≈",
    "𝔘",
]


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOS, IM_START],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
    )


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def _byte_to_char():
    # The byte-level alphabet (as in GPT-2): printable bytes stand for
    # themselves, the rest are shifted to code points from 256 up.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1)]
    printable += range(ord("\u00ae"), ord("\u00ff") + 1)
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


BYTE_TO_CHAR = _byte_to_char()


def byte_token_ids(tokenizer, text):
    """One single-byte token per UTF-8 byte of text (no merges)."""
    return tokenizer.convert_tokens_to_ids([BYTE_TO_CHAR[b] for b in text.encode("utf-8")])


def stream(tokenizer, prompt_ids, gen_ids, **kwargs):
    """Feed gen_ids one by one (stopping after a stop match); return (detok, deltas)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, **kwargs)
    deltas = []
    for token_id in gen_ids:
        deltas.append(detok.add_token(token_id))
        if detok.matched_stop is not None:
            break
    deltas.append(detok.finish())
    assert detok.text == "".join(deltas)
    return detok, deltas


def random_text(rng, n_chars):
    return "".join(rng.choice(ALPHABET) for _ in range(n_chars))


def test_tokenizer_splits_rare_characters(tokenizer):
    # Sanity for the tests below: an unseen emoji takes several tokens, while
    # a frequent word is one token.
    assert len(encode(tokenizer, "🦀")) >= 2
    assert tokenizer.decode(byte_token_ids(tokenizer, "🦀 é")) == "🦀 é"
    assert len(encode(tokenizer, "hello")) == 1
    assert len(encode(tokenizer, " world")) == 1


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_concatenate_to_full_decode_random_ids(tokenizer, skip_special_tokens):
    # Arbitrary token ids, including lone bytes that form invalid UTF-8 and
    # special tokens: the streamed text must still equal the full decode.
    rng = random.Random(1234)
    vocab_size = len(tokenizer)
    for _ in range(150):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randrange(0, 8))]
        gen = [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 30))]
        _, deltas = stream(tokenizer, prompt, gen, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == tokenizer.decode(gen, skip_special_tokens=skip_special_tokens)


def test_deltas_concatenate_to_full_decode_valid_text(tokenizer):
    rng = random.Random(99)
    for _ in range(150):
        prompt = encode(tokenizer, random_text(rng, rng.randrange(0, 12)))
        text = random_text(rng, rng.randrange(1, 40))
        gen = encode(tokenizer, text)
        _, deltas = stream(tokenizer, prompt, gen)
        assert "".join(deltas) == tokenizer.decode(gen, skip_special_tokens=True) == text
        # A partial character is never released for valid text.
        assert all(REPLACEMENT not in delta for delta in deltas)


def test_prompt_ending_mid_character(tokenizer):
    # The prompt ends with the first two bytes of "🦀"; the generated ids are
    # the last two bytes. Decoding the generated ids alone gives replacement
    # characters, and the stream must agree with that.
    crab = byte_token_ids(tokenizer, "🦀")
    prompt = encode(tokenizer, "hi ") + crab[:2]
    _, deltas = stream(tokenizer, prompt, crab[2:] + encode(tokenizer, " ok"))
    assert "".join(deltas) == tokenizer.decode(crab[2:] + encode(tokenizer, " ok"))


def test_emoji_split_across_byte_tokens(tokenizer):
    prompt = encode(tokenizer, "hello")
    gen = encode(tokenizer, " 🦀!")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add_token(t) for t in gen]
    assert "".join(deltas) == " 🦀!"
    assert all(REPLACEMENT not in delta for delta in deltas)
    # Nothing at all is released while the emoji is incomplete.
    crab = byte_token_ids(tokenizer, "🦀")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert [detok.add_token(t) for t in crab] == ["", "", "", "🦀"]
    assert detok.finish() == ""
    assert detok.text == "🦀"


def test_text_before_incomplete_character_in_same_token_is_released(tokenizer):
    # "ĠðŁ" is a merged token: a space plus the first two bytes of an emoji.
    # The space is complete and must not wait for the rest of the emoji.
    space_and_emoji_start = tokenizer.convert_tokens_to_ids("ĠðŁ")
    assert tokenizer.decode([space_and_emoji_start]) == " " + REPLACEMENT
    crab = byte_token_ids(tokenizer, "🦀")
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "say"))
    assert detok.add_token(encode(tokenizer, "hello")[0]) == "hello"
    assert detok.add_token(space_and_emoji_start) == " "
    assert detok.add_token(crab[2]) == ""
    assert detok.add_token(crab[3]) == "🦀"
    # A sequence that stays broken is released as decoded, by finish().
    assert detok.add_token(crab[0]) == ""
    assert detok.add_token(crab[1]) == ""
    assert detok.finish() == tokenizer.decode(crab[:2])
    assert detok.text == "hello 🦀" + tokenizer.decode(crab[:2])


def test_window_stays_small(tokenizer):
    # Per-token cost must not grow with the length generated so far.
    class CountingTokenizer:
        def __init__(self, inner):
            self.inner = inner
            self.longest = 0

        def decode(self, ids, **kwargs):
            self.longest = max(self.longest, len(ids))
            return self.inner.decode(ids, **kwargs)

    counting = CountingTokenizer(tokenizer)
    text = "hello world, café 日本語 😀 🦀 " * 40
    gen = encode(tokenizer, text)
    assert len(gen) > 400
    detok = IncrementalDetokenizer(counting, encode(tokenizer, "say " * 30))
    for token_id in gen:
        detok.add_token(token_id)
    detok.finish()
    assert detok.text == text
    assert counting.longest <= 10


def test_stop_inside_one_token(tokenizer):
    gen = encode(tokenizer, "say hello world")
    assert "Ġhello" in tokenizer.convert_ids_to_tokens(gen)  # "Ġ" is the space
    detok, deltas = stream(tokenizer, [], gen, stop=["ell"])
    assert detok.matched_stop == "ell"
    assert detok.text == "say h"
    # add_token must not be called after a match.
    with pytest.raises(RuntimeError):
        detok.add_token(gen[-1])


def test_stop_straddling_tokens(tokenizer):
    gen = encode(tokenizer, "say hello world again")
    detok, _ = stream(tokenizer, [], gen, stop=["lo wor"])
    assert detok.matched_stop == "lo wor"
    assert detok.text == "say hel"


def test_stop_straddling_byte_tokens_of_a_character(tokenizer):
    gen = encode(tokenizer, "hello 🦀🦀 world")
    detok, deltas = stream(tokenizer, [], gen, stop=["🦀 w"])
    assert detok.matched_stop == "🦀 w"
    assert detok.text == "hello 🦀"
    assert all(REPLACEMENT not in d for d in deltas)


def test_stop_at_very_start(tokenizer):
    gen = encode(tokenizer, "say hello world")
    detok, deltas = stream(tokenizer, encode(tokenizer, "prompt: "), gen, stop=["say"])
    assert detok.matched_stop == "say"
    assert deltas == ["", ""]  # matched on the first token; finish() adds nothing
    assert detok.text == ""


def test_near_miss_is_released(tokenizer):
    gen = encode(tokenizer, "hello world hello there")
    assert tokenizer.convert_ids_to_tokens(gen)[:2] == ["hello", "Ġworld"]
    assert tokenizer.decode(gen[-1:]) == "re"
    detok = IncrementalDetokenizer(tokenizer, [], stop=["hello thery"])
    # "hello" could begin the stop string: held back...
    assert detok.add_token(gen[0]) == ""
    # ...until the next text rules it out.
    assert detok.add_token(gen[1]) == "hello world"
    for token_id in gen[2:-1]:
        detok.add_token(token_id)
    assert detok.text == "hello world "
    # "hello the" could still begin "hello thery"; with "re" it is a near miss.
    assert detok.add_token(gen[-1]) == "hello there"
    assert detok.matched_stop is None
    assert detok.finish() == ""
    assert detok.text == "hello world hello there"


def test_partial_stop_at_end_released_by_finish(tokenizer):
    gen = encode(tokenizer, "say hel")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["help"])
    released = "".join(detok.add_token(t) for t in gen)
    assert released == "say "
    assert detok.text == "say "
    assert detok.finish() == "hel"
    assert detok.text == "say hel"
    assert detok.matched_stop is None


def test_include_stop_str_in_output(tokenizer):
    gen = encode(tokenizer, "say hello world again")
    detok, _ = stream(tokenizer, [], gen, stop=["lo wor"], include_stop_str_in_output=True)
    assert detok.matched_stop == "lo wor"
    assert detok.text == "say hello wor"


def test_two_stop_strings_earliest_wins(tokenizer):
    gen = encode(tokenizer, "the quick brown fox jumps over the lazy dog")
    for stops in (["lazy", "brown"], ["brown", "lazy"]):
        detok, _ = stream(tokenizer, [], gen, stop=stops)
        assert detok.matched_stop == "brown"
        assert detok.text == "the quick "
    # Overlapping: the occurrence completed first wins, whatever the order.
    gen = encode(tokenizer, "say hello world")
    for stops in (["world", "lo w"], ["lo w", "world"]):
        detok, _ = stream(tokenizer, [], gen, stop=stops)
        assert detok.matched_stop == "lo w"
        assert detok.text == "say hel"


def test_stops_match_full_text_reference(tokenizer):
    # Property: whatever the token boundaries, the result is the one computed
    # on the whole decoded text.
    rng = random.Random(7)
    stop_pool = ["o w", "日本", "😀 ", "é", "xyz", "hello there", "🦀!", "a b"]
    for _ in range(150):
        text = random_text(rng, rng.randrange(1, 40))
        if rng.random() < 0.5:
            text += rng.choice(stop_pool)
        stops = rng.sample(stop_pool, rng.randrange(1, 4))
        include = rng.random() < 0.5
        gen = encode(tokenizer, text)
        detok, deltas = stream(tokenizer, [], gen, stop=stops, include_stop_str_in_output=include)

        hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
        if hits:
            end, start, stop = min(hits)
            assert detok.matched_stop == stop
            assert detok.text == text[: end if include else start]
        else:
            assert detok.matched_stop is None
            assert detok.text == text
        assert all(REPLACEMENT not in d for d in deltas)


def test_skip_special_tokens(tokenizer):
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    im_id = tokenizer.convert_tokens_to_ids(IM_START)
    gen = [im_id] + encode(tokenizer, "hello") + [eos_id] + encode(tokenizer, " world") + [eos_id]

    _, deltas = stream(tokenizer, [], gen, skip_special_tokens=True)
    assert "".join(deltas) == "hello world"

    _, deltas = stream(tokenizer, [], gen, skip_special_tokens=False)
    assert "".join(deltas) == f"{IM_START}hello{EOS} world{EOS}"
    assert "".join(deltas) == tokenizer.decode(gen, skip_special_tokens=False)


def test_special_token_in_prompt_context(tokenizer):
    prompt = [tokenizer.convert_tokens_to_ids(IM_START)] + encode(tokenizer, "assistant\n")
    gen = encode(tokenizer, "café 😀")
    for skip in (True, False):
        _, deltas = stream(tokenizer, prompt, gen, skip_special_tokens=skip)
        assert "".join(deltas) == "café 😀"


def test_stop_given_as_plain_string_and_empty_stops_ignored(tokenizer):
    gen = encode(tokenizer, "say hello world")
    detok, _ = stream(tokenizer, [], gen, stop="world")
    assert detok.matched_stop == "world"
    assert detok.text == "say hello "
    detok, _ = stream(tokenizer, [], gen, stop=["", "nope"])
    assert detok.matched_stop is None
    assert detok.text == "say hello world"
