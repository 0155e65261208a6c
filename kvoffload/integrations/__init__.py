"""Bridges from kvoffload to other serving systems. Each sub-package imports its system lazily;
importing :mod:`kvoffload` never imports any of them."""
