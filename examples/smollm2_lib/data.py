"""The demo's two text domains, tokenised with SmolLM2's own tokenizer (49152 tokens).

The same texts as the toy demo (``cpu_demo_lib.corpus``), no download: domain A is the Python
standard library's top-level sources (code; its first ``max_chars`` characters, enough for the
warm heads' pretraining and cheap to tokenise), domain B the English ``pydoc_data.topics``. The
held-out split interleaves blocks of ``BLOCK`` tokens, as the toy's does with bytes.
"""

import hashlib
from typing import Optional

import torch

from cpu_demo_lib.corpus import Corpus, pydoc_topics_bytes, split_held_out, stdlib_sources_bytes

#: Held-out blocks of this many tokens (about the toy's 2048 bytes).
BLOCK = 512


def load_domain(name: str, which: str, tokenizer, min_tokens: int,
                max_chars: Optional[int] = None) -> Corpus:
    """Domain ``which`` ('stdlib' or 'pydoc') as token ids with a train / held-out split."""
    if which == 'stdlib':
        data, source = stdlib_sources_bytes(), 'python stdlib *.py sources'
    elif which == 'pydoc':
        data, source = pydoc_topics_bytes(), 'pydoc_data.topics (English docs)'
    else:
        raise ValueError(f"domain {which!r}; expected 'stdlib' or 'pydoc'")
    text = data.decode('utf-8', 'replace')
    if max_chars is not None and len(text) > max_chars:
        text, source = text[:max_chars], f'{source}, first {max_chars} characters'
    ids = tokenizer(text, add_special_tokens=False, verbose=False)['input_ids']
    tokens = torch.tensor(ids, dtype=torch.long)
    train, held_out = split_held_out(tokens, name, source, min_tokens, BLOCK)
    encoded = text.encode('utf-8')
    return Corpus(name, source, train, held_out, len(encoded), hashlib.sha256(encoded).hexdigest())
