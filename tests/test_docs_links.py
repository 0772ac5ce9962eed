"""Every relative link and image in ``README.md`` and ``docs/`` resolves: the file exists and, for
``page.md#anchor`` links, the page has a heading with that anchor (GitHub's rule)."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / 'README.md', *sorted((REPO / 'docs').glob('*.md'))]

#: ``[text](target)`` and ``![alt](target)``; the target ends at whitespace or ``)``.
LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)')
FENCE = re.compile(r'^(```|~~~)')


def _prose(text: str) -> str:
    """The page without fenced code blocks and inline code, where brackets are not links."""
    kept, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            in_fence = not in_fence
            continue
        if not in_fence and not line.startswith('    '):
            kept.append(re.sub(r'`[^`]*`', '', line))
    return '\n'.join(kept)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r'[`*]', '', heading.strip().lower())
    text = re.sub(r'[^\w\- ]', '', text)
    return text.replace(' ', '-')


def anchors(page: Path) -> set:
    headings = re.findall(r'^#{1,6}\s+(.+?)\s*$', _prose(page.read_text()), flags=re.M)
    return {github_anchor(h) for h in headings}


def relative_links(page: Path):
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r'^[a-z][a-z0-9+.-]*:', target):  # http:, https:, mailto:
            continue
        yield target


def test_the_docs_exist_and_link_to_something():
    assert len(PAGES) > 5
    assert sum(1 for page in PAGES for _ in relative_links(page)) > 20


@pytest.mark.parametrize('page', PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition('#')
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f'{target}: {resolved} does not exist')
        elif anchor and resolved.suffix == '.md' and anchor not in anchors(resolved):
            broken.append(f'{target}: no heading with anchor #{anchor} in {resolved.name}')
    assert not broken, f'{page.relative_to(REPO)}:\n' + '\n'.join(broken)


def test_every_docs_page_is_reachable_from_the_readme():
    """No orphan page: each docs/ page is linked from the README or from a page it links."""
    seen, todo = set(), [REPO / 'README.md']
    while todo:
        page = todo.pop()
        if page in seen or page.suffix != '.md' or not page.exists():
            continue
        seen.add(page)
        todo.extend((page.parent / t.partition('#')[0]).resolve() for t in relative_links(page) if t.partition('#')[0])
    orphans = [p.name for p in PAGES if p not in seen]
    assert not orphans, f'docs pages no link reaches from README.md: {orphans}'


def test_anchor_rule_matches_github():
    assert github_anchor("Upstream Megatron-LM's names") == 'upstream-megatron-lms-names'
    assert github_anchor('Launcher: `pretrain_gpt.py` without a patch') == 'launcher-pretrain_gptpy-without-a-patch'
