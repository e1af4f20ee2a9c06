import runpy
import sys

import pytest

from conftest import ROOT

SCRIPT = str(ROOT / "scripts" / "schedule_csv.py")


def _run(monkeypatch, *args: str) -> int:
    monkeypatch.setattr(sys, "argv", [SCRIPT, *args])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(SCRIPT, run_name="__main__")
    return done.value.code


def test_schedule_csv_script_writes_a_runnable_csv_or_refuses(monkeypatch, capsys):
    assert _run(monkeypatch, "interleaved_1f1b", "--pp", "2", "--microbatches", "4") == 0
    assert capsys.readouterr().out == (ROOT / "examples" / "interleaved_1f1b_pp2_m4.csv").read_text()
    assert _run(monkeypatch, "1f1b") == 1
    assert "not runnable" in capsys.readouterr().err
