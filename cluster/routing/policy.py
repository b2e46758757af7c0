"""Routing policies; the code lives in ``cluster.routing.policies`` (one module
per family), re-exported here so that existing imports keep working."""

from cluster.routing.policies import *  # noqa: F401,F403
from cluster.routing.policies import __all__  # noqa: F401
