"""The ``tokentrail`` command line and the process launcher for ``up`` and ``demo``."""
