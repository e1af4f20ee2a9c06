"""How a rank ends: ``runner.ranks.dist.cleanup`` leaves no process-group thread behind, so no C++
thread of torch's can touch Python while the interpreter finalizes (in Python 3.11 such a thread,
asking for the GIL, is ended by ``pthread_exit``: "terminate called without an active exception",
SIGABRT, a run or test failing at random after its work was done)."""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch
import torch.distributed as dist

from runner.parallel.dims import ParallelDims
from runner.parallel.mesh import _cached_device_mesh, build_mesh
from runner.ranks.dist import DistEnv, cleanup, live_group_threads
from runner.ranks.processes import spawn


def _collective_finishing_at_exit(env: DistEnv) -> None:
    """Rank 1's last collective, on the pipeline group of the cached mesh (as training leaves it),
    completes only after rank 1 returned: its callback then runs on a gloo thread and needs the
    GIL. With the group still alive when the interpreter finalizes, rank 1 aborts."""
    group = build_mesh(env, ParallelDims(pp=2, dp=1)).pp_group
    if env.rank == 0:
        time.sleep(1.0)  # rank 1 is in its cleanup by then
    work = dist.all_reduce(torch.ones(4), group=group, async_op=True)
    work.get_future().then(lambda fut: fut.value())


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_collective_finishing_as_a_rank_ends_does_not_abort_it(tmp_path, capfd):
    # spawn, as the tests' ranks and CUDA runs start: a forked rank leaves through os._exit, without
    # the interpreter's finalization (where the abort happens).
    with spawn(2, _collective_finishing_at_exit, directory=tmp_path, method="spawn", timeout_s=30) as ranks:
        ranks.join()  # raised ProcessExitedException (SIGABRT) while the cached mesh kept its groups
    assert "terminate called" not in capfd.readouterr().err


def _group_threads_started(within_s: float = 10.0) -> list[str]:
    """The groups' threads, once they have named themselves: a new thread sets its name when it
    first runs, which on a loaded host can come a while after the group exists."""
    deadline = time.monotonic() + within_s
    while not (names := live_group_threads()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return names


def test_cleanup_ends_the_threads_of_the_groups_a_cached_mesh_holds(tmp_path, caplog):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        # build_mesh caches the mesh of a multi-rank layout (its groups are collective to create); a
        # (1, 1) mesh on this one-rank group stands for it (build_mesh makes none for one rank).
        mesh = _cached_device_mesh(DistEnv(0, 2, torch.device("cpu")), (("pp", 1), ("dp", 1)))
        assert mesh is not None and mesh["pp"].get_group() is not None and _group_threads_started()
        del mesh
    finally:
        cleanup()
    assert live_group_threads() == []  # before: gloo_tcp_loop and pt_gloo_runloop, the cache's group's
    assert "still running" not in caplog.text
    assert _cached_device_mesh.cache_info().currsize == 0


def test_cleanup_ends_the_groups_of_a_mesh_compiled_code_still_holds(tmp_path, caplog):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = _cached_device_mesh(DistEnv(0, 2, torch.device("cpu")), (("pp", 1), ("tp", 1)))
        assert mesh is not None
        # Dynamo's guards keep DTensor specs alive past the run, so their meshes: the run's tp
        # submesh (and its root), and copies, which rebuild their own registry of groups.
        kept = [mesh["tp"], copy.deepcopy(mesh)]
        assert kept[0].get_group() is not None and kept[1]._pg_registry and _group_threads_started()
    finally:
        cleanup()
    assert live_group_threads() == []  # before: the root mesh's registry kept the groups
    assert "still running" not in caplog.text
    del mesh, kept


def test_cleanup_names_the_threads_of_a_group_something_still_holds(tmp_path, caplog):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    held = dist.new_group([0])
    cleanup()
    assert "process-group threads still running after destroy_process_group (gloo_tcp_loop, pt_gloo_runloop" \
        in caplog.text
    del held
    assert live_group_threads() == []


def _nothing(env: DistEnv) -> None:
    pass


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_forked_rank_ends_without_the_heap_scans_an_interpreters_exit_needs(tmp_path, monkeypatch):
    # A forked rank leaves through os._exit: no finalization, so no thread of a group can abort
    # it, and cleanup's heap scan and collection (0.3 CPU-s a rank) are skipped; every rank's heap
    # is frozen as it ends (a spawned rank's finalization would scan it once more for nothing).
    import runner.ranks.processes as processes

    def recording_cleanup(*, end_threads: bool = True) -> None:
        (tmp_path / f"cleanup-{os.getpid()}").write_text(str(end_threads))
        real_cleanup(end_threads=end_threads)

    real_cleanup = processes.cleanup
    monkeypatch.setattr(processes, "cleanup", recording_cleanup)  # forked ranks inherit both
    monkeypatch.setattr(processes.gc, "freeze", lambda: (tmp_path / f"freeze-{os.getpid()}").write_text(""))
    with spawn(2, _nothing, directory=tmp_path, method="fork", timeout_s=30) as ranks:
        ranks.join()
    assert sorted(p.read_text() for p in tmp_path.glob("cleanup-*")) == ["False", "False"]
    assert len(list(tmp_path.glob("freeze-*"))) == 2
