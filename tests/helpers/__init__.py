"""What the test modules share; no test module imports another.

- ``config``: the repository's paths, the tiny model every run uses (``TINY``), ``compose``.
- ``cli``: the one way tests run a command line (``python -m runner ...``) as a subprocess.
- ``ranks``: ``spawn`` N gloo ranks once and ``train_cases`` many runs on them.
- ``parity``: the unsplit reference, cases run on shared ranks, and the comparison against it.
- ``models``: user-style model, loss and data factories (``model._target_=helpers.models...``).
- ``hf``: tiny Hugging Face models, tokenizers and their own unsplit training.
- ``profiled``: what a profiled run's files must hold.
- ``plan``: fixed planner inputs (no calibration ranks) and synthetic stage costs.
- ``tier``: the check that only tests marked ``multiprocess`` start processes (conftest.py).

Spawned ranks import these modules by name (``helpers.ranks.train_cases`` is pickled), so
``tests/`` is on ``sys.path`` in the test process (conftest.py) and on ``PYTHONPATH`` for the
command lines (``cli``)."""
