"""The ``kvoffload`` command line."""
