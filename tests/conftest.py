"""Hooks every test goes through (GPU skips, one thread, the multiprocess check); what tests
share otherwise is in ``helpers/``."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:  # `helpers` imports in any import mode; spawned ranks inherit sys.path
    sys.path.insert(0, TESTS)

from helpers import tier  # noqa: E402

tier.install()


# The collector's full passes walk every object of this process, and a test session's heap is large
# (torch, Hydra, transformers, every test module): at ~0.2 s a pass they were seconds of each file.
# What is alive as a test module begins (imports, session fixtures, the pools) is frozen
# (``gc.freeze``), after a collection: later passes walk what the module itself made. Frozen
# objects are still freed when their references go; only a cycle among them would wait, and a
# module's garbage is collected before its objects are frozen.
_frozen_at: list[object] = []


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session):
    gc.disable()  # importing the test modules makes few cycles; each pass then walked the growing heap


def pytest_collection_finish(session):
    gc.enable()
    gc.collect()
    gc.freeze()


def _freeze_before_module(item) -> None:
    if _frozen_at[:1] != [item.module]:  # the module's first test, before its module-scoped fixtures
        _frozen_at[:] = [item.module]
        gc.collect()
        gc.freeze()


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    if not config.option.collectonly:  # mypy, when its test is selected: in the background from now, its test last
        from helpers import lint

        items[:] = lint.start_in_background(items)


def pytest_sessionfinish(session):
    if "helpers.lint" in sys.modules:
        sys.modules["helpers.lint"].stop()


_threads: list[int] = []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # Before the test's fixtures, module-scoped ones (a shared spawn, its references) included.
    # The test process runs references next to spawned ranks on 2 cores: keep it to one thread.
    _freeze_before_module(item)
    _threads[:] = [torch.get_num_threads()]
    torch.set_num_threads(1)
    tier.begin(item.nodeid, marked=item.get_closest_marker("multiprocess") is not None)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    tier.end()
    if _threads:
        torch.set_num_threads(_threads.pop())


@pytest.fixture(scope="session", autouse=True)
def _pooled_ranks():
    """The ranks ``helpers.ranks`` keeps between spawns end with the session, each leaving cleanly."""
    yield
    if "helpers.ranks" in sys.modules:
        sys.modules["helpers.ranks"].close_pools()


@pytest.fixture(scope="session")
def trained_llama(tmp_path_factory) -> Path:
    """One tiny Llama trained 2 steps by the runner (``helpers.trained.train_tiny_llama``): the
    session's one such run, exported by test_export and sampled from by test_generate. Tests read it
    and write elsewhere."""
    from helpers.trained import train_tiny_llama

    return train_tiny_llama(tmp_path_factory.mktemp("export"))
