"""The ranks of a run as processes: how they start (``processes.spawn``, ``env``: torchrun, srun,
submitit), how the launcher watches them (``supervise``, ``watchdog``), the process group and device of
each (``dist``), the terminal (``console``) and the startup's clock (``clock``).
Schema: ``config.LaunchConfig`` (``launch.*``). Nothing is imported here."""
