"""Incremental detokenization: append-only streaming text of a growing token sequence.

Decoding the whole sequence after every token and sending what changed is not append-only: a
tokenizer's ``decode`` may change characters it already returned when more tokens follow. Two cases
occur with the tokenizers of ``oxygen_ros/models/tokenizer.py``:

- an incomplete UTF-8 sequence of byte-fallback tokens decodes to U+FFFD replacement characters
  until its last byte arrives (``'caf'`` + ``<0xC3>`` → ``'caf\\ufffd'``, + ``<0xA9>`` → ``'café'``),
  and the tiny tokenizer's ``ByteFallback`` decoder turns a whole run of byte tokens into one U+FFFD
  per byte as soon as the run is invalid (``'café'`` + ``<0xC3>`` → ``'caf\\ufffd\\ufffd\\ufffd'``);
- SentencePiece drops the leading space of the first piece it decodes (``'▁world'`` alone decodes to
  ``'world'``, after ``'▁hello'`` to ``' world'``), so a token cannot be decoded on its own; decoders
  that clean up spaces (``'hello '`` + ``'.'`` → ``'hello.'``) change text already decoded.

:class:`IncrementalDetokenizer` decodes a short window of context tokens plus the new ones, as the
incremental detokenizers of LLM servers do (vLLM, HF text-generation-inference: a *prefix offset*
where the context starts and a *read offset* up to which text has been sent), and sends only text
that is stable: never while the window ends with U+FFFD (an incomplete character), and never text
that would contradict what was sent. What it sends is therefore append-only for any tokenizer, and
the final text is by construction the concatenation of everything sent.
"""

from __future__ import annotations

import unicodedata
from typing import Callable, Sequence

REPLACEMENT_CHARACTER = "\ufffd"

# Unicode general categories that carry nothing to say: separators (spaces, line and paragraph
# separators), control and format characters, surrogates, private use and unassigned code points.
_UNSPEAKABLE_CATEGORIES = frozenset({"Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co", "Cn"})


def is_speakable(text: str) -> bool:
    """Whether ``text`` has at least one character a speech engine can say.

    False for empty text and for text made only of whitespace, control or format characters
    (Unicode categories Z* and C*) and U+FFFD replacement characters (what undecodable bytes become).
    """
    return any(char != REPLACEMENT_CHARACTER and unicodedata.category(char) not in _UNSPEAKABLE_CATEGORIES
               for char in text)


def _unstable(text: str) -> bool:
    """Nothing new yet, or text that more tokens will still change: an incomplete multi-byte character
    (U+FFFD at the end)."""
    return not text or text.endswith(REPLACEMENT_CHARACTER)


class IncrementalDetokenizer:
    """Streams the text of one request's generated tokens, append-only.

    Args:
        decode: the tokenizer's ``decode``: token ids -> text (e.g. the engine processor's
            ``detokenize``). Called with slices of the generated ids only.

    Attributes:
        text: all text sent so far; after :meth:`finish`, the request's whole text.

    State: ``ids`` (tokens added), ``prefix_offset`` (first token of the decoding context),
    ``read_offset`` (text of the tokens before it has been sent). After each token the window
    ``ids[prefix_offset:]`` is decoded; its text beyond that of ``ids[prefix_offset:read_offset]``
    is sent when it is stable, and the offsets then move to ``(read_offset, len(ids))``. When the
    window's text no longer starts with the context's text (decoding more tokens changed characters
    already sent), later context starts are tried, down to none; text already sent is never taken
    back.

    Guarantees: :meth:`add` and :meth:`finish` return deltas whose concatenation is :attr:`text`;
    every value :attr:`text` takes is a prefix of all later ones. :attr:`text` equals
    ``decode(ids)`` whenever the tokenizer's decoding of growing prefixes only ever appends once
    characters are complete (both tokenizers of ``oxygen_ros/models``); invalid byte sequences
    become one U+FFFD per undecodable byte (``'café'`` + ``<0xC3>`` + ``'▁o'`` →
    ``'café\\ufffd o'``, where the tiny tokenizer's ``decode`` of the whole gives
    ``'caf\\ufffd\\ufffd\\ufffd o'``).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""      # decode(ids[prefix_offset:read_offset])
        self.text = ""
        self._finished = False

    @property
    def token_ids(self) -> list[int]:
        """The tokens added so far (a copy)."""
        return list(self._ids)

    @property
    def held_back(self) -> int:
        """Tokens added whose text has not been sent yet."""
        return len(self._ids) - self._read_offset

    def add(self, token_id: int) -> str:
        """Add one generated token; return the newly stable text ('' while it is held back).

        Raises:
            RuntimeError: after :meth:`finish`.
        """
        if self._finished:
            raise RuntimeError("token added to a finished detokenizer")
        self._ids.append(int(token_id))
        return self._advance(final=False)

    def finish(self) -> str:
        """End the sequence: return the text still held back ('' if none), unstable or not.

        An incomplete multi-byte sequence at the end is sent as the tokenizer decodes it (U+FFFD).
        Idempotent: a second call returns ''.
        """
        if self._finished:
            return ""
        self._finished = True
        if self._read_offset == len(self._ids):
            return ""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        ids, read = self._ids, self._read_offset
        for start in range(self._prefix_offset, read + 1):
            prefix = self._prefix_text if start == self._prefix_offset else self._decode(ids[start:read])
            window = self._decode(ids[start:])
            if not window.startswith(prefix):
                continue    # this context decodes differently now: try a shorter one
            new = window[len(prefix):]
            if not final and _unstable(new):
                return ""   # wait for more tokens
            self._prefix_offset, self._read_offset = read, len(ids)
            self._prefix_text = self._decode(ids[read:])
            self.text += new
            return new
        # Unreachable: with start == read the context is empty and every window starts with ''.
        raise AssertionError("no decoding context matched")
