"""The package's version, in the lowest layer: the server's ``/version`` reads it without importing the package
root (the layering, ``tests/package``)."""

__version__ = "0.1.0"
