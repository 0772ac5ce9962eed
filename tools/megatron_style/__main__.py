"""``python -m tools.megatron_style``: format the package's modules and the unit tests the
patches ship as Megatron-LM does (the header added where missing), then list what pylint still
finds in what the patches ship."""

import sys

from . import HEADER, COPYRIGHT, formatted, problems


def main() -> int:
    sys.path.insert(0, 'tools')
    from patchgen.package import PACKAGE_DIR, UPSTREAM_TESTS_DIR, new_files, shipped_tests

    for path in sorted([*PACKAGE_DIR.glob('*.py'), *UPSTREAM_TESTS_DIR.rglob('test_*.py')]):
        text = path.read_text()
        if not COPYRIGHT.match(text.split('\n', 1)[0]):
            text = f'{HEADER}\n\n{text}'
        path.write_text(formatted(text))
    found = problems({**new_files(), **shipped_tests()})
    print('\n'.join(found) or 'clean')
    return 1 if found else 0


if __name__ == '__main__':
    sys.exit(main())
