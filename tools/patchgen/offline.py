"""Staleness without the target tree: check a committed patch (:func:`check_offline`) and bring
it up to date in place (:func:`regenerate_offline`), the same bytes as a regeneration from the
tree.

Every patch is split into its files; the new package files must equal the package source, and
the lines each patch adds to (and removes from) Megatron files must equal what the generator
renders for that tree from the facts recorded in :data:`~patchgen.targets.TARGETS`.
"""

import re
from dataclasses import dataclass
from typing import Dict, List, Optional

from .facts import fact_problems
from .layout import TARGET_PACKAGE, PatchError
from .package import patch_files
from .render import new_file_diff, render_header
from .snippets import expected_changes, expected_edits
from .targets import Target


@dataclass
class FileDiff:
    path: str
    new_file: bool
    added: List[str]
    removed: List[str]


def parse_patch(text: str) -> Dict[str, FileDiff]:
    """Split a patch made by :func:`render_patch` into its files."""
    out: Dict[str, FileDiff] = {}
    current: Optional[FileDiff] = None
    in_hunk = False
    for line in text.split('\n'):
        if line.startswith('diff --git a/'):
            path = line.split(' b/', 1)[1]
            current = out[path] = FileDiff(path, False, [], [])
            in_hunk = False
        elif current is None:
            continue
        elif not in_hunk and line.startswith('new file mode'):
            current.new_file = True
        elif line.startswith('@@'):
            in_hunk = True
        elif in_hunk and line.startswith('+'):
            current.added.append(line[1:])
        elif in_hunk and line.startswith('-'):
            current.removed.append(line[1:])
    return out


def check_offline(target: Target, text: str) -> List[str]:
    """Problems of a committed patch that can be found without the target tree."""
    problems = [f'recorded facts: {p}' for p in fact_problems(target.facts)]
    if not text.startswith(render_header(target)):
        problems.append('the header (text before the first diff) differs from what the generator '
                        'renders now')
    files = parse_patch(text)
    shipped = patch_files(target.facts)
    in_patch = {p for p, d in files.items() if d.new_file or p.startswith(TARGET_PACKAGE + '/')}
    for p in sorted(set(shipped) ^ in_patch):
        problems.append(f'{p}: {"missing from" if p in shipped else "no longer in"} the package')
    for p in sorted(set(shipped) & in_patch):
        d = files[p]
        if not d.new_file or d.removed or d.added != shipped[p].split('\n')[:-1]:
            problems.append(f'{p}: differs from what the package source renders')
    for path, (added, removed) in expected_changes(target.facts).items():
        d = files.get(path)
        if d is None:
            problems.append(f'{path}: not in the patch')
            continue
        if d.added != added:
            problems.append(f'{path}: added lines differ from what the generator renders now')
        if d.removed != removed:
            problems.append(f'{path}: removed lines differ from what the generator renders now')
    extra = set(files) - set(expected_changes(target.facts)) - in_patch
    for p in sorted(extra):
        problems.append(f'{p}: unexpected file in the patch')
    return problems


def regenerate_offline(target: Target, text: str) -> str:
    """Bring a committed patch up to date without its tree.

    The package files are re-rendered from the package source; in each Megatron hunk the lines
    of every edit are re-rendered while the context and removed lines (the tree's own code) are
    kept, and the hunk headers recounted. Raises :class:`PatchError` when that is not possible:
    the edits no longer line up with the committed hunks, or what an edit removes changed (both
    need the tree: ``--megatron-lm``).
    """
    _, _, rest = text.partition('diff --git ')
    sections = ['diff --git ' + part for part in rest.split('\ndiff --git ')]
    sections = [sec if sec.endswith('\n') else sec + '\n' for sec in sections]
    edits = expected_edits(target.facts)
    out = [render_header(target)]
    for sec in sections:
        path = sec.split('\n', 1)[0].split(' b/', 1)[1]
        if '\nnew file mode ' in sec.split('\n@@', 1)[0]:
            continue  # re-rendered below
        if path not in edits:
            raise PatchError(f'{target.name}: unexpected file {path} in the patch')
        out.append(_rerender_hunks(target.name, path, sec, edits[path]))
    for path, text_ in sorted(patch_files(target.facts).items()):
        out.append(new_file_diff(path, text_))
    new = ''.join(out)
    problems = check_offline(target, new)
    if problems:
        raise PatchError(f'{target.name}: offline regeneration failed: {problems}')
    return new


def _rerender_hunks(name: str, path: str, section: str, edits) -> str:
    head, _, body = section.partition('\n@@')
    lines = ('@@' + body).split('\n')[:-1]
    hunks, current = [], None
    for line in lines:
        if line.startswith('@@'):
            m = re.match(r'@@ -(\d+),(\d+) \+(\d+),(\d+) @@', line)
            current = [int(m.group(1)), int(m.group(2)), []]
            hunks.append(current)
        else:
            current[2].append(line)
    # runs of changed lines: each is one edit ('-' lines then '+' lines)
    queue = list(edits)
    out = [head + '\n']
    offset = 0
    for old_start, old_len, body_lines in hunks:
        new_body, i = [], 0
        while i < len(body_lines):
            if body_lines[i][:1] == ' ':
                new_body.append(body_lines[i])
                i += 1
                continue
            removed, added = [], []
            while i < len(body_lines) and body_lines[i][:1] == '-':
                removed.append(body_lines[i][1:])
                i += 1
            while i < len(body_lines) and body_lines[i][:1] == '+':
                added.append(body_lines[i][1:])
                i += 1
            if not queue:
                raise PatchError(f'{name}: {path}: more changed runs than edits; needs the tree')
            new_added, new_removed = queue.pop(0)
            if removed != new_removed:
                raise PatchError(f'{name}: {path}: an edit now removes other lines; needs the tree')
            new_body += ['-' + l for l in removed] + ['+' + l for l in new_added]
        n_removed = sum(1 for l in new_body if l[:1] == '-')
        n_added = sum(1 for l in new_body if l[:1] == '+')
        new_len = old_len - n_removed + n_added
        out.append(f'@@ -{old_start},{old_len} +{old_start + offset},{new_len} @@\n')
        out.append(''.join(l + '\n' for l in new_body))
        offset += n_added - n_removed
    if queue:
        raise PatchError(f'{name}: {path}: fewer changed runs than edits; needs the tree')
    return ''.join(out)
