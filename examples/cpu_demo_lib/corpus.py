"""The two text domains as byte tokens (vocabulary 256), with a held-out split and seeded batches.

Defaults need no download: every Python installation carries them.

* Domain A (pretraining): the Python standard library's own top-level ``*.py`` sources (code).
* Domain B (drift and healing): the English reference text of ``pydoc_data.topics`` (the
  ``help()`` topics: language-reference prose about statements, operators and types).

A user's own files replace either one (read as bytes; any encoding). The tokenizer is the identity
on bytes, so there is nothing to train and nothing to ship.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Tuple

if TYPE_CHECKING:  # torch is imported where it is used, so that bad paths fail fast
    import torch

VOCAB_SIZE = 256
#: Held-out split: every ``HELD_OUT_EVERY``-th block of ``BLOCK`` bytes (interleaved, so both
#: splits cover the whole corpus rather than its head and its tail).
BLOCK = 2048
HELD_OUT_EVERY = 10


class CorpusError(ValueError):
    """A corpus that cannot be used (missing, empty, too short)."""


@dataclass
class Corpus:
    """One domain: its train and held-out byte tokens and where they came from."""

    name: str
    source: str
    train: torch.Tensor  # [n] int64
    held_out: torch.Tensor  # [m] int64
    num_bytes: int
    sha256: str

    def describe(self) -> dict:
        return {
            'name': self.name, 'source': self.source, 'bytes': self.num_bytes,
            'train_tokens': int(self.train.numel()), 'held_out_tokens': int(self.held_out.numel()),
            'sha256': self.sha256,
        }


def stdlib_files() -> List[Tuple[str, bytes]]:
    """The standard library's top-level ``*.py`` files: ``(name, contents)``, sorted by name."""
    stdlib = sysconfig.get_paths()['stdlib']
    out = []
    for path in sorted(glob.glob(os.path.join(stdlib, '*.py'))):
        with open(path, 'rb') as f:
            out.append((os.path.basename(path), f.read()))
    return out


def stdlib_sources_bytes() -> bytes:
    """Domain A default: the standard library's top-level ``*.py`` files, sorted by name."""
    return b'\n\n'.join(contents for _, contents in stdlib_files())


def pydoc_topics_bytes() -> bytes:
    """Domain B default: the English text of ``pydoc_data.topics`` (topics sorted by name)."""
    from pydoc_data.topics import topics

    return '\n\n'.join(topics[key] for key in sorted(topics)).encode('utf-8')


def read_text_file(path: str) -> bytes:
    """A user's corpus file, as bytes; a clear :class:`CorpusError` if it is unusable."""
    if not os.path.exists(path):
        raise CorpusError(f'corpus file {path!r} does not exist')
    if os.path.isdir(path):
        raise CorpusError(f'corpus path {path!r} is a directory; pass a text file')
    with open(path, 'rb') as f:
        data = f.read()
    if not data.strip():
        raise CorpusError(f'corpus file {path!r} is empty')
    return data


def load_corpus(name: str, path: Optional[str], default: str, min_tokens: int) -> Corpus:
    """Load a domain from ``path`` (a user file) or the built-in ``default`` ('stdlib'/'pydoc').

    Args:
        name: 'A' or 'B', for messages.
        path: a user's text file, or None for the default.
        default: 'stdlib' or 'pydoc'.
        min_tokens: the smallest usable held-out and train split (one sequence window).
    """
    import torch

    if path is not None:
        data, source = read_text_file(path), os.path.abspath(path)
    elif default == 'stdlib':
        data, source = stdlib_sources_bytes(), 'python stdlib *.py sources'
    else:
        data, source = pydoc_topics_bytes(), 'pydoc_data.topics (English docs)'
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    train, held_out = split_held_out(tokens, name, source, min_tokens, BLOCK, 'bytes')
    return Corpus(name, source, train, held_out, len(data), hashlib.sha256(data).hexdigest())


def split_held_out(tokens: torch.Tensor, name: str, source: str, min_tokens: int, block: int,
                   unit: str = 'tokens'):
    """``(train, held_out)``: every ``HELD_OUT_EVERY``-th block of ``block`` tokens held out.

    A corpus too small for that holds out its last tenth; one too small for a ``min_tokens``
    window in each split raises :class:`CorpusError` (``unit`` names its tokens in the message).
    """
    import torch

    blocks = torch.arange(tokens.numel()) // block
    held = blocks % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
    train, held_out = tokens[~held], tokens[held]
    if held_out.numel() < min_tokens:  # a small file: hold out its last tenth instead
        cut = tokens.numel() - max(min_tokens, tokens.numel() // HELD_OUT_EVERY)
        train, held_out = tokens[:cut], tokens[cut:]
    if train.numel() < min_tokens or held_out.numel() < min_tokens:
        raise CorpusError(
            f'corpus {name} ({source}) has {tokens.numel()} {unit}; it needs at least '
            f'{2 * min_tokens} (one {min_tokens}-token window for training and one held out); '
            'use a longer file or a smaller --seq-length'
        )
    return train, held_out


def windows(tokens: torch.Tensor, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` windows of ``length`` consecutive tokens at seeded random offsets: ``[count, length]``."""
    import torch

    starts = torch.randint(0, tokens.numel() - length + 1, (count,), generator=generator)
    return tokens[starts.unsqueeze(1) + torch.arange(length)]


class Batches:
    """Seeded training batches ``(tokens, labels)`` of shape ``[b, s]`` from one split."""

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_length: int, seed: int):
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_length = seq_length
        import torch

        self.generator = torch.Generator().manual_seed(seed)

    def next(self):
        window = windows(self.tokens, self.batch_size, self.seq_length + 1, self.generator)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()
