"""The planner: predicted step time, bubble and memory of every layout before running it, and
schedules searched for a model's measured costs (``python -m runner.plan``).

- ``planner``: candidates, their checks and predictions, ties and the recommendation;
- ``costs``: per-child F/B/I/W, update and memory costs, timed in this process;
- ``calibrate``: message and runtime costs, measured on two real ranks;
- ``simulate``: a schedule's per-rank orders as a weighted event simulation (also used by runs to
  replay their own measured costs);
- ``synthesize``: the search for an order under a memory budget;
- ``report``: the printed table; ``__main__``: the command line.

Nothing is imported here, so that a run reaching for the simulator does not load the planner.
"""
