"""The planner: predicted step time, bubble and memory of every layout before running it, and
schedules searched for a model's measured costs (``python -m runner.plan``).

- ``planner``: candidates, their checks and predictions, ties and the recommendation;
- ``costs``: per-child F/B/I/W, update and memory costs, timed in this process;
- ``calibrate``: message and runtime costs, measured on two real ranks;
- the event simulation of a schedule's per-rank orders is ``runner.pipeline.simulate`` (runs replay
  their own measured costs with it, so it lives below the planner);
- ``synthesize``: the search for an order under a memory budget;
- ``report``: the printed table; ``__main__``: the command line.

Nothing of the run is imported here; nothing of the run imports this package (tests/test_architecture.py's
LAYERS). The package is callable: ``runner.plan(overrides)`` is ``runner.api.plan`` (the Python
API), imported on the first call.
"""

import importlib
import sys
import types
from typing import Any


class _PlanPackage(types.ModuleType):
    """This package, callable as ``runner.plan([...])``: ``runner.plan`` is the package once any of
    its modules is imported, so the API's function is reached through it."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return importlib.import_module("runner.api").plan(*args, **kwargs)


sys.modules[__name__].__class__ = _PlanPackage
