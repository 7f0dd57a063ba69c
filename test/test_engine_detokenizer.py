"""Incremental detokenization (oxygen_ros/engine/detokenizer.py) with scripted token sequences for the
tokenizers of oxygen_ros/models/tokenizer.py, and the engine's streamed text events built on it.

Invariants checked everywhere: every partial text is a prefix of the next and of the final text, the
deltas concatenate exactly to the final text, and text that is not yet stable is held back."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oxygen_ros.engine import Engine, RequestStatus
from oxygen_ros.engine.detokenizer import IncrementalDetokenizer, is_speakable
from oxygen_ros.models import load_model
from oxygen_ros.models.tokenizer import PaliGemmaTokenizer, TinyTokenizer
from engine_support import SPEECH, ByteIO, engine_config, observation

TINY = TinyTokenizer(2048)


def stream(decode, ids):
    """Feed ``ids`` one by one, then finish: (delta per token, final delta, final text), with the
    invariants asserted on the way."""
    detokenizer = IncrementalDetokenizer(decode)
    deltas, texts = [], []
    for token in ids:
        deltas.append(detokenizer.add(token))
        texts.append(detokenizer.text)
    final_delta = detokenizer.finish()
    final = detokenizer.text
    assert "".join(deltas) + final_delta == final
    for earlier, later in zip(texts, texts[1:] + [final]):
        assert later.startswith(earlier)
    assert detokenizer.finish() == "" and detokenizer.text == final
    return deltas, final_delta, final


def tiny_ids(*pieces: str) -> list[int]:
    """Token ids of the tiny tokenizer's vocabulary entries (e.g. '▁c', '<0xC3>')."""
    ids = [TINY._tokenizer.token_to_id(piece) for piece in pieces]
    assert None not in ids, pieces
    return ids


# ---- the tiny byte-fallback tokenizer -----------------------------------------------------------

@pytest.mark.parametrize("text", ["pick up the red cube", "café ole", "日本 ok", "a 😀 b", "hello, world.",
                                  "Task: open the drawer\nthen stop", "naïve  façade"])
def test_tiny_tokenizer_stream_equals_the_whole_decode(text):
    ids = TINY.encode(text)
    deltas, final_delta, final = stream(TINY.decode, ids)
    assert final == TINY.decode(ids) == text


def test_incomplete_multibyte_character_is_held_back():
    ids = tiny_ids("▁c", "a", "f", "<0xC3>", "<0xA9>")              # 'café': é is C3 A9
    assert TINY.decode(ids[:4]) == "caf\ufffd"                       # what decoding the prefix gives
    deltas, final_delta, final = stream(TINY.decode, ids)
    assert deltas == ["c", "a", "f", "", "é"] and final_delta == "" and final == "café"

    ids = TINY.encode("日本")                                         # two 3-byte characters
    deltas, _, final = stream(TINY.decode, ids)
    assert [d for d in deltas if d] == ["日", "本"] and final == "日本"
    assert "\ufffd" not in "".join(deltas)


def test_a_broken_byte_run_does_not_resend_the_text():
    # The case: 'café' then a lone <0xC3> and '▁o'. Decoding the whole sequence gives
    # 'caf\ufffd\ufffd\ufffd o' (the run of byte tokens is invalid, every byte of it becomes U+FFFD),
    # which no longer starts with the 'café' already streamed.
    ids = tiny_ids("▁c", "a", "f", "<0xC3>", "<0xA9>", "<0xC3>", "▁o")
    assert TINY.decode(ids) == "caf\ufffd\ufffd\ufffd o"
    deltas, final_delta, final = stream(TINY.decode, ids)
    assert final == "café\ufffd o"                                   # one U+FFFD for the one bad byte
    assert deltas == ["c", "a", "f", "", "é", "", "\ufffd o"] and final_delta == ""


def test_incomplete_sequence_at_the_end_is_sent_by_the_final_delta():
    ids = tiny_ids("▁c", "a", "f", "<0xC3>")
    deltas, final_delta, final = stream(TINY.decode, ids)
    assert "".join(deltas) == "caf" and final_delta == "\ufffd" and final == TINY.decode(ids)


def test_whitespace_streams_as_it_comes():
    ids = tiny_ids("▁pick", "▁", "▁", "▁up")
    deltas, final_delta, final = stream(TINY.decode, ids)
    assert deltas == ["pick", " ", " ", " up"] and final == "pick   up" == TINY.decode(ids)
    # Whitespace only (what random weights say): the first '▁' decodes to nothing (SentencePiece drops
    # the leading space), so it waits; the rest streams.
    deltas, final_delta, final = stream(TINY.decode, tiny_ids("▁", "▁", "▁", "▁"))
    assert deltas == ["", " ", " ", " "] and final_delta == "" and final == "   "


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 700), max_size=24))
def test_any_tiny_token_sequence_streams_append_only(ids):
    # Byte tokens (4-259) in random order: invalid and incomplete UTF-8 everywhere.
    deltas, final_delta, final = stream(TINY.decode, ids)
    prefixes = [TINY.decode(ids[:k]) for k in range(len(ids) + 1)]
    if all(b.startswith(a) for a, b in zip(prefixes, prefixes[1:])):
        assert final == TINY.decode(ids)   # a tokenizer that only appends: the same text


# ---- SentencePiece (PaliGemma's kind): leading space, byte fallback -------------------------------

@pytest.fixture(scope="module")
def sentencepiece_tokenizer(tmp_path_factory):
    """A real SentencePiece BPE model with byte fallback and PaliGemma's special ids, trained here on
    a few sentences (milliseconds), loaded through the node's PaliGemmaTokenizer."""
    import sentencepiece

    sentences = ["pick up the red cube and place it in the bowl", "open the drawer", "hello world",
                 "move the arm to the left", "grasp the blue block, then stop."] * 20
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, vocab_size=320, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        minloglevel=2)
    path = tmp_path_factory.mktemp("sp") / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return PaliGemmaTokenizer(path)


def test_sentencepiece_needs_context_for_the_leading_space(sentencepiece_tokenizer):
    sp = sentencepiece_tokenizer
    ids = sp.encode("hello world")
    # A piece decoded alone loses its leading space: per-token decoding would give 'helloworld'.
    assert "".join(sp.decode([i]) for i in ids) != "hello world"
    deltas, final_delta, final = stream(sp.decode, ids)
    assert final == "hello world" == sp.decode(ids)
    assert any(d.startswith(" ") for d in deltas)


@pytest.mark.parametrize("text", ["pick up the red cube", "café ole", "日本 ok", "grasp the blue block, then stop.",
                                  "  two spaces"])
def test_sentencepiece_stream_equals_the_whole_decode(sentencepiece_tokenizer, text):
    sp = sentencepiece_tokenizer
    ids = sp.encode(text)
    deltas, final_delta, final = stream(sp.decode, ids)
    assert final == sp.decode(ids)
    assert "\ufffd" not in "".join(deltas)


# ---- decoders that change earlier characters ---------------------------------------------------

class CleanupTokenizer:
    """Scripted pieces with a decoder that rewrites text it already returned, as HF's
    ``clean_up_tokenization_spaces`` (' .' -> '.') and a ligature rule ('fi' -> 'ﬁ') do."""

    PIECES = ["hello", " ", ".", " world", "f", "i", "!"]

    def decode(self, ids):
        text = "".join(self.PIECES[i] for i in ids)
        return text.replace(" .", ".").replace("fi", "\ufb01")


@pytest.mark.parametrize("ids, whole, streamed", [
    ([0, 1, 2, 3], "hello. world", "hello . world"),      # 'hello' ' ' '.' ' world': the space was sent
    ([4, 5, 6], "\ufb01!", "fi!"),                          # 'f' 'i' '!': the 'f' was sent
])
def test_text_already_sent_is_never_taken_back(ids, whole, streamed):
    tokenizer = CleanupTokenizer()
    deltas, final_delta, final = stream(tokenizer.decode, ids)
    assert tokenizer.decode(ids) == whole and final == streamed


# ---- speakable text -----------------------------------------------------------------------------

@pytest.mark.parametrize("text, speakable", [
    ("", False), ("     ", False), ("\n\t ", False), ("\ufffd\ufffd", False), (" \ufffd\x00\x1b ", False),
    ("\u200b\u2028", False), ("\ue000", False),
    ("hello", True), (" ok ", True), ("日本", True), ("\ufffd a", True), ("42", True), ("é", True),
])
def test_is_speakable(text, speakable):
    assert is_speakable(text) is speakable


# ---- through the engine -------------------------------------------------------------------------

class TinyTextProcessor(ByteIO):
    """The engine tests' processor, detokenizing with the tiny tokenizer (vocabulary 1024, a quarter
    of it byte-fallback tokens)."""

    def detokenize(self, ids):
        return TINY_1024.decode(list(ids))


TINY_1024 = TinyTokenizer(1024)


@pytest.fixture(scope="module")
def model():
    return load_model("pi05_tiny", dtype=torch.float32, seed=7)


def test_engine_text_events_are_append_only(model):
    # Temperature sampling from the random model: near-uniform tokens, so byte tokens in random order
    # (incomplete and invalid UTF-8) in most requests. Each request's event stream must be append-only
    # and add up to the incremental decode of its tokens.
    task = dict(SPEECH, max_new_tokens=12, sampling={"temperature": 50.0, "seed": 3})
    engine = Engine(model, TinyTextProcessor(model.config),
                    engine_config("unified", [task], decode_steps_per_cycle=3))
    events = []
    for seq in range(8):
        events += engine.run_cycle(observation(seq, masked=("left_wrist_0_rgb",))).text_events
    events += engine.flush()[0]
    engine.close()
    by_request: dict[int, list] = {}
    for event in events:
        by_request.setdefault(event.request_id, []).append(event)
    assert len(by_request) == 8
    rewritten = 0
    for request_events in by_request.values():
        *partials, final = request_events
        assert final.final and not any(e.final for e in partials)          # exactly one final, last
        assert final.status == RequestStatus.COMPLETED and len(final.token_ids) == 12
        assert all(e.delta for e in partials)                              # no empty partial
        for i, event in enumerate(request_events):                         # text = deltas so far
            assert event.text == "".join(e.delta for e in request_events[:i + 1])
            assert final.text.startswith(event.text)
        assert final.text == stream(TINY_1024.decode, final.token_ids)[2]
        prefixes = [TINY_1024.decode(final.token_ids[:k]) for k in range(13)]
        rewritten += not all(b.startswith(a) for a, b in zip(prefixes, prefixes[1:]))
    assert rewritten >= 1, "no request had text that decoding more tokens rewrote: the case is untested"
