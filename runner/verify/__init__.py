"""``verify=true``: the unsplit model trained beside the run on rank 0 and compared with it.

Entry points: ``hook.Verify`` (the hook the trainer holds), ``compare`` (the rules and their
tolerances: gradients, weights in units of the learning rate, later losses and norms),
``exact.float64_step`` (the unsplit first step rerun in float64 where the strict check failed,
which tells rounding from a defect), ``memory.check_reference_fits`` (whether the reference fits,
checked before launch)."""
