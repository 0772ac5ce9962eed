"""Stand-in: every name is off (see the package docstring)."""

from ._off import __all__, __getattr__  # noqa: F401  (PEP 562: every name this module is asked for)
