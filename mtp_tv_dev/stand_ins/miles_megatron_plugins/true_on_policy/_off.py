"""What every stand-in module answers: off (see the package docstring)."""

class _Off:
    """Every attribute, call and truth test: off."""
    def __getattr__(self, name):
        if name.startswith('__'):
            raise AttributeError(name)
        return _Off()
    def __call__(self, *args, **kwargs):
        return _Off()
    def __bool__(self):
        return False
    def __iter__(self):
        return iter(())
    def __eq__(self, other):
        return other is None or other is False
    __hash__ = object.__hash__

__all__ = []

def __getattr__(name):
    if name.startswith('__'):
        raise AttributeError(name)
    return _Off()
