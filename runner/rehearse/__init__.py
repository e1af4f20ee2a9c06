"""Rehearsal: every distinct rank role of a run, measured alone on the machine at hand
(``python -m runner rehearse=on ...``, see docs/rehearsal.md).

Entry points:

* ``runner.rehearse.world.init_rehearsal(rank, world_size, device)``: this process joins a
  rehearsal process group as ``rank`` of ``world_size``; every peer is answered locally
  (``runner._torch.rehearsal``, the one module with torch's private API for it), and
  ``collectives_by_dim(dims)`` names what it issued by mesh dimension;
* ``runner.rehearse.launch.rehearse(cfg, run_dir)``: the command: checks, then each rehearsed rank
  in a process of its own through the runner's own training code (``runner.rehearse.rank``),
  composed into the whole step (``runner.rehearse.compose``), written to ``rehearsal.json``;
* ``runner.rehearse.config.RehearseConfig``: the ``rehearse`` config group's schema.

Nothing here is imported by a real run; importing this package imports no torch.
"""
