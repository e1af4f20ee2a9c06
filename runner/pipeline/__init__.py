"""Pipeline schedules and the step that runs them: the schedule registry (``registry``), schedules as
torch runs them (``schedule``; ``csv_file`` reads CSV files, ``zb_orders`` the Zero Bubble orders),
the compute action (``ops.Op``), the rank's stages and step callable (``step``), what ran at each
stage (``recorder``) and schedules as event simulations (``simulate``).
Schema: ``config.ScheduleConfig`` (``schedule=...``). Nothing is imported here."""
