"""Benchmarks: pipeline efficiency, scaling and memory, training options, runner overhead, startup,
profiling cost, the planner against real runs (three model sizes), synthesized schedules against the
built-ins, and what one device measures alone. Each section saves its raw results to
benchmarks/<section>.json; BENCHMARKS.md is rendered from every JSON file present (tables and
observations alike, so nothing in it is written by hand), and re-running one section refreshes
only that part.

    python scripts/bench.py                                # every section (~1.5 h on 2 cores, plus waits)
    python scripts/bench.py --only options startup         # these sections; the others' JSON is kept
    python scripts/bench.py --only efficiency --pp 2 --microbatches 8
    python scripts/bench.py --render                       # re-render BENCHMARKS.md (and the plot) only
    python scripts/bench.py --device cuda                  # on GPUs: benchmarks/cuda/, BENCHMARKS-cuda.md
    python scripts/bench.py --only planner synthesis --quick   # do they run (tiny models, ~5 min)

Before each long run the script waits (up to --max-wait s) until the 1-minute load average is at
most 1.0 and no pytest is running, and records per section whether it ran under load. Benchmarks
write numbers and never fail on one: a failed run is recorded with its error. Every number in one
table comes from one invocation on one machine; ratios, not absolute times, carry over.

Layout: ``sections/<name>.py`` runs one section and renders its part (registered in
``sections/__init__.py``); ``programs/`` holds the baselines run as their own processes;
``runs.py`` starts the runner and reads what a run wrote; ``machine.py`` watches the load;
``markdown.py`` formats; ``document.py`` assembles BENCHMARKS.md; ``cli.py`` is the command line.
"""
