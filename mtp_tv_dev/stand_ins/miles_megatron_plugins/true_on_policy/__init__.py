"""Stand-in modules: see the package docstring."""
