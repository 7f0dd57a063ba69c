"""Tokenizers: the PaliGemma SentencePiece model (full presets) and an offline tiny BPE (tiny presets).

Both expose the same small interface (:class:`TextTokenizer`): ``encode(text, add_bos)``,
``decode(ids)``, ``pad_id`` 0, ``eos_id`` 1, ``bos_id`` 2 (PaliGemma's specials) and ``vocab_size``.
Neither ever downloads anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from .config import VLAConfig

PAD_ID, EOS_ID, BOS_ID = 0, 1, 2

# Words of the prompt templates and of common manipulation instructions get whole tokens in the tiny
# vocabulary so that prompts stay short; anything else falls back to characters, then to bytes.
_TINY_WORDS = (
    "Task State Action Subtask task state action subtask pick up place put the a an on in into of to and "
    "open close drawer cube block bowl plate cup mug box left right top bottom red green blue yellow "
    "black white move push pull grasp lift stack turn it from with").split()


class TextTokenizer(Protocol):
    """What the processing code needs from a tokenizer."""

    pad_id: int
    eos_id: int
    bos_id: int
    vocab_size: int

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of ``text`` (with BOS first if ``add_bos``)."""

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; special tokens are dropped."""


class TinyTokenizer:
    """Offline SentencePiece-style BPE built in code with the ``tokenizers`` library.

    Vocabulary (deterministic): ids 0-3 ``<pad> <eos> <bos> <unk>``, 4-259 byte-fallback tokens
    ``<0x00>``-``<0xFF>``, then printable ASCII characters and ``▁`` (the SentencePiece space), then
    ``▁0`` … ``▁255`` (one token per discretised state bin) and template / instruction words with their
    BPE prefixes. Any UTF-8 text round-trips through :meth:`encode` / :meth:`decode`.

    Args:
        vocab_size: model vocabulary size; must hold the built vocabulary.

    Raises:
        ValueError: ``vocab_size`` smaller than the built vocabulary.
    """

    pad_id, eos_id, bos_id = PAD_ID, EOS_ID, BOS_ID

    def __init__(self, vocab_size: int):
        vocab: dict[str, int] = {}

        def add(token: str) -> None:
            vocab.setdefault(token, len(vocab))

        for token in ("<pad>", "<eos>", "<bos>", "<unk>"):
            add(token)
        for byte in range(256):
            add(f"<0x{byte:02X}>")
        for code in range(32, 127):
            add(chr(code))
        add("▁")
        words = [f"▁{n}" for n in range(256)] + [f"▁{w}" for w in _TINY_WORDS]
        merges: list[tuple[str, str]] = []
        for length in range(2, max(len(w) for w in words) + 1):
            for word in words:
                if len(word) >= length and word[:length] not in vocab:
                    merges.append((word[:length - 1], word[length - 1]))
                    add(word[:length])
        if len(vocab) > vocab_size:
            raise ValueError(f"tiny tokenizer needs {len(vocab)} ids, model vocab_size is {vocab_size}")
        self.vocab_size = vocab_size
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"),
            pre_tokenizers.Punctuation(behavior="isolated"),
        ])
        tok.decoder = decoders.Sequence([
            decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
        self._tokenizer = tok

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode([i for i in ids if i > 3], skip_special_tokens=False)


class PaliGemmaTokenizer:
    """The PaliGemma SentencePiece model (vocab 257152; pad 0, EOS 1, BOS 2) from a local file.

    Args:
        model_path: path of ``paligemma_tokenizer.model`` (as openpi and LeRobot ship it).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not a SentencePiece model.
    """

    pad_id, eos_id, bos_id = PAD_ID, EOS_ID, BOS_ID

    def __init__(self, model_path: str | Path):
        import sentencepiece

        path = Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(f"PaliGemma SentencePiece model not found: {path}")
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except RuntimeError as error:   # sentencepiece reports a malformed model as RuntimeError
            raise ValueError(f"{path} is not a SentencePiece model: {error}") from error
        self.vocab_size = self._sp.get_piece_size()

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._sp.encode(text)
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode([i for i in ids if i not in (self.pad_id, self.eos_id, self.bos_id)])


def load_tokenizer(config: VLAConfig, tokenizer_path: str | Path | None = None) -> TextTokenizer:
    """The tokenizer for ``config``: :class:`TinyTokenizer` for ``tokenizer='tiny'`` presets, else the
    PaliGemma SentencePiece model at ``tokenizer_path``.

    Raises:
        ValueError: a PaliGemma preset without ``tokenizer_path``, a file that is not a SentencePiece
            model, or a tokenizer larger than the model vocabulary.
        FileNotFoundError: ``tokenizer_path`` does not exist.
    """
    if config.tokenizer == "tiny":
        return TinyTokenizer(config.vocab_size)
    if tokenizer_path is None:
        raise ValueError(f"preset {config.name!r} needs tokenizer_path= the local PaliGemma SentencePiece model "
                         "(paligemma_tokenizer.model); nothing is downloaded")
    tokenizer = PaliGemmaTokenizer(tokenizer_path)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} pieces, model vocab_size is {config.vocab_size}")
    return tokenizer
