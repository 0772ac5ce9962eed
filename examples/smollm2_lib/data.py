"""The demo's text, tokenised with SmolLM2's own tokenizer (49152 tokens).

No download: the Python standard library's top-level sources (code; the first ``max_chars``
characters), or the English ``pydoc_data.topics`` (the ``help()`` topics, about 120k tokens).
Each is cut into blocks of consecutive tokens (:data:`BLOCK` by default), and the blocks are
dealt into three splits by position (interleaved, so that every split spans the whole text):

* ``train``: 7 blocks in 10; a training window is one block (inputs ``[:-1]``, labels ``[1:]``);
* ``validation``: 1 in 10, for the learning-rate sweep and the held-out curves;
* ``test``: 2 in 10, for every reported number, dealt again into disjoint blocks per use
  (:func:`test_roles`): teacher-forced windows, the prompts of the speculative runs, and those
  of the main model's sampled continuations.

A window never crosses from one split into another. :func:`load_files_domain` splits the
standard library by file instead (a file's blocks all go to one split: no held-out block shares a
file, and so its names and idioms, with a training block), and holds out a fourth split, ``rl``:
the files whose functions prompt the policy's rollouts in the RL scenario.
"""

import hashlib
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from cpu_demo_lib.corpus import pydoc_topics_bytes, stdlib_files, stdlib_sources_bytes

#: Tokens per block by default: a 512-token training window and its labels.
BLOCK = 513
#: ``block index % 10`` -> split.
SPLIT_OF = {0: 'train', 1: 'train', 2: 'train', 3: 'train', 4: 'validation', 5: 'train',
            6: 'train', 7: 'test', 8: 'train', 9: 'test'}


#: ``sha256(file name) % 10`` -> split, for :func:`load_files_domain`.
SPLIT_OF_FILE = {0: 'train', 1: 'train', 2: 'train', 3: 'rl', 4: 'validation', 5: 'train',
                 6: 'train', 7: 'test', 8: 'train', 9: 'test'}


@dataclass
class Domain:
    """One domain's blocks per split: ``[n, block]`` int64 tensors."""

    name: str
    source: str
    train: torch.Tensor
    validation: torch.Tensor
    test: torch.Tensor
    sha256: str
    files: Optional[Dict[str, List[str]]] = None
    """Split -> file names (:func:`load_files_domain`; None: split by block)."""
    rl_files: Optional[Dict[str, str]] = None
    """The ``rl`` split's files, name -> text (:func:`load_files_domain`)."""

    def describe(self) -> Dict:
        out = {'name': self.name, 'source': self.source, 'block_tokens': self.train.shape[1],
               'blocks': {s: int(getattr(self, s).shape[0])
                          for s in ('train', 'validation', 'test')},
               'sha256': self.sha256}
        if self.files is not None:
            out['files'] = {s: len(names) for s, names in self.files.items()}
        return out


def load_domain(name: str, which: str, tokenizer, max_chars: Optional[int] = None,
                block: int = BLOCK) -> Domain:
    """Domain ``which`` (``'stdlib'`` or ``'pydoc'``) as blocks of ``block`` token ids per
    split."""
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
    blocks = torch.tensor(ids[: len(ids) // block * block], dtype=torch.long).view(-1, block)
    split = [SPLIT_OF[i % 10] for i in range(blocks.shape[0])]
    parts = {s: blocks[[i for i, x in enumerate(split) if x == s]]
             for s in ('train', 'validation', 'test')}
    for s, part in parts.items():
        if part.shape[0] == 0:
            raise ValueError(f'domain {name} ({source}) has {len(ids)} tokens: no {s} block of '
                             f'{block}; raise max_chars')
    return Domain(name, source, parts['train'], parts['validation'], parts['test'],
                  hashlib.sha256(text.encode('utf-8')).hexdigest())


def split_of_file(name: str) -> str:
    """The split a file's blocks go to (stable across machines: a hash of its name)."""
    return SPLIT_OF_FILE[int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 10]


def load_files_domain(tokenizer, block: int = BLOCK, max_chars: Optional[int] = None) -> Domain:
    """The standard library's top-level sources split by file (:data:`SPLIT_OF_FILE`): each
    split's files joined and cut into blocks; the ``rl`` split's files kept as text.
    ``max_chars`` (tests): each split keeps the first ``max_chars`` times its share of the
    buckets of its joined text (None: all)."""
    files = stdlib_files()
    names: Dict[str, List[str]] = {s: [] for s in ('train', 'rl', 'validation', 'test')}
    texts: Dict[str, List[str]] = {s: [] for s in names}
    for name, contents in files:
        split = split_of_file(name)
        names[split].append(name)
        texts[split].append(contents.decode('utf-8', 'replace'))
    parts = {}
    for split in ('train', 'validation', 'test'):
        text = '\n\n'.join(texts[split])
        if max_chars is not None:
            share = sum(1 for s in SPLIT_OF_FILE.values() if s == split) / len(SPLIT_OF_FILE)
            text = text[: int(max_chars * share)]
        ids = tokenizer(text, add_special_tokens=False, verbose=False)['input_ids']
        parts[split] = torch.tensor(ids[: len(ids) // block * block],
                                    dtype=torch.long).view(-1, block)
    digest = hashlib.sha256()
    for name, contents in files:
        digest.update(name.encode() + b'\0' + contents)
    return Domain('code', 'python stdlib *.py sources, split by file', parts['train'],
                  parts['validation'], parts['test'], digest.hexdigest(), files=names,
                  rl_files=dict(zip(names['rl'], texts['rl'])))


def test_roles(domain: Domain, tf_windows: int, spec_prompts: int,
               continuation_prompts: int) -> Dict[str, torch.Tensor]:
    """The test split dealt into disjoint blocks per use, so that no two measurements share
    text: ``'tf'`` (teacher-forced windows), ``'spec'`` (speculative-decoding prompts: each
    block's opening) and ``'continuation'`` (openings the main model continues), ``[n, block]``
    each."""
    need = tf_windows + spec_prompts + continuation_prompts
    blocks = domain.test
    if need > blocks.shape[0]:
        raise ValueError(f'domain {domain.name}: {tf_windows} teacher-forced windows, '
                         f'{spec_prompts} prompts and {continuation_prompts} continuation prompts '
                         f'need {need} test blocks, the split has {blocks.shape[0]}; raise '
                         f'max_chars')
    spec_end = tf_windows + spec_prompts
    return {'tf': blocks[:tf_windows], 'spec': blocks[tf_windows:spec_end],
            'continuation': blocks[spec_end:need]}
