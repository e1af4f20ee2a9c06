"""The baselines the runner is measured against, each run as its own process (``python <file>``)."""
