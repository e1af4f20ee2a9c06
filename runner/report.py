"""Shim (relayout: keep-file): the sweep report moved to ``runner.outputs.sweep_report`` (issue #34).

Kept for the command ``python -m runner.report <multirun directory>`` and for the callback
``_target_: runner.report.SweepReport`` that an older sweep's ``.hydra/config.yaml`` names.
"""

import sys

from runner.outputs.sweep_report import ERROR_FILE, SweepReport, collect_rows, main, write_report

__all__ = ["collect_rows", "write_report", "SweepReport", "ERROR_FILE", "main"]

if __name__ == "__main__":
    sys.exit(main())
