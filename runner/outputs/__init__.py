"""What a run writes: metrics and the summary (``metrics``), the profiler window and schedule files
(``profile``), the merged timeline (``timeline``), tp's collectives (``collectives``), versions and
host (``provenance``), sweep reports (``sweep_report``) and the experiment loggers (``loggers``).
Schema: ``config.LoggingConfig`` (``logging.*``). Nothing is imported here."""
