# mypy: disable-error-code="override"
# (torch's stubs overload each collective with its Python-API form; a backend implements the options form)
"""The rehearsal process group: one process plays rank ``r`` of a world of ``N``, and every peer is
answered here, locally. Every use of torch's private distributed API the rehearsal needs is in
this file (like ``runner/_torch/pp.py`` and ``runner/_torch/dist.py`` for the real runs): the
``Work`` made from a future (``torch._C._distributed_c10d._create_work_from_future``), the options
classes of the collectives, the backend plug-in's registry; and torch's memory tracker
(``torch.distributed._tools.mem_tracker``, private), which ``peak_tracker`` adapts to stages
called once per microbatch. Tested with torch 2.13, and with 2.11 (the GPU image's) on CPU.

Peers are assumed symmetric (every tp shard and dp replica does what this rank does), so each
collective completes at once with a result of the right shape and dtype and finite values:

* all-reduce (and reduce): ``SUM`` leaves ``value * group_size`` (equal peers), ``AVG``, ``MAX``,
  ``MIN`` and the bitwise ones leave the value, ``PRODUCT`` leaves it too (a power could overflow);
* all-gather (every form): the local shard, replicated; reduce-scatter: this rank's chunk of the
  input, scaled as all-reduce scales; all-to-all: the input, in place of every peer's;
* broadcast: the local value (every rank built the same); scatter: the root's chunk where the
  root is here, else a small finite fill; gather: copies of the input;
* send: nothing (recorded); recv: ``RECV_FILL`` for floating tensors, 1 for integer ones. The
  pipeline schedules' static/dynamic vote (an int32[1] multiplied along the stages, on a schedule's
  first step) so reads 1: every peer voted static, as a real run of stages built with static
  metadata would (it is counted as ``vote_send``/``vote_recv``, not as a message of the pipeline, and
  so is torch 2.11's first-step exchange with the neighbouring stages, a float32 scalar);
* barrier: nothing.

Every call is counted in ``Ledger`` by kind and by the group's ranks, with the bytes this rank
passes (its larger buffer: the gathered output, the reduced input, the sent or received tensor).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]  # private, no stub
from torch.futures import Future

__all__ = ["BACKEND", "RECV_FILL", "Ledger", "RehearsalGroup", "register", "ledger", "peak_tracker", "peak_split"]

BACKEND = "rehearse"
RECV_FILL = 0.01  # what a received floating tensor holds: finite, small, not zero (no silent no-op)


@dataclass
class Ledger:
    """The collectives this process issued: ``calls[(kind, ranks)] = [count, bytes]``, ``ranks``
    the group's global ranks (the caller names the dimension they span)."""

    calls: dict[tuple[str, tuple[int, ...]], list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, ranks: tuple[int, ...], nbytes: int) -> None:
        with self.lock:
            entry = self.calls[(kind, ranks)]
            entry[0] += 1
            entry[1] += nbytes

    def clear(self) -> None:
        with self.lock:
            self.calls.clear()

    def snapshot(self) -> list[tuple[str, tuple[int, ...], int, int]]:
        with self.lock:
            return [(kind, ranks, c, b) for (kind, ranks), (c, b) in sorted(self.calls.items())]


_LEDGER = Ledger()


def ledger() -> Ledger:
    """This process's ledger (one rehearsed rank per process)."""
    return _LEDGER


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _done(result) -> dist.Work:
    fut: Future = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


def _fill(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.fill_(RECV_FILL if (t.is_floating_point() or t.is_complex()) else 1)


def _p2p_kind(kind: str, tensors) -> str:
    """``send``/``recv``, or ``vote_send``/``vote_recv`` for a schedule's handshake on its first step,
    one element (no activation or gradient is one): torch 2.13's static/dynamic vote (an int32[1]),
    torch 2.11's exchange with its neighbours that sets up the batched messages (a float32 scalar).
    The composed step costs the pipeline's messages from ``send``'s bytes per message, which a
    4-byte handshake would dilute."""
    handshake = len(tensors) == 1 and tensors[0].numel() == 1
    return f"vote_{kind}" if handshake else kind


class RehearsalGroup(dist.ProcessGroup):
    """A process group whose peers are this process (see the module's docstring)."""

    def __init__(self, rank: int, size: int, name: str, ranks: tuple[int, ...], book: Ledger):
        super().__init__(rank, size)  # type: ignore[call-arg]  # the (rank, size) form, not in the stubs
        self._rank, self._size, self._name, self._ranks, self._book = rank, size, name, ranks, book

    # Python groups skip ``_set_group_name``: functional collectives find the group by this name.
    @property
    def group_name(self) -> str:
        return self._name

    def getBackendName(self) -> str:
        return BACKEND

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def __repr__(self) -> str:
        return f"RehearsalGroup(rank {self._rank} of {self._size}, ranks {self._ranks[:8]}…)"

    def _log(self, kind: str, nbytes: int) -> None:
        self._book.add(kind, self._ranks, nbytes)

    def _scale(self, t: torch.Tensor, op) -> None:
        if op == dist.ReduceOp.SUM and self._size > 1 and t.dtype != torch.bool:
            with torch.no_grad():
                t.mul_(self._size)

    # -- reductions --------------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for t in tensors:
            self._scale(t, op)
        self._log("all_reduce", _nbytes(tensors))
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def reduce_scatter(self, outputs, inputs, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for out, chunks in zip(outputs, inputs):
            out.copy_(chunks[self._rank])
            self._scale(out, op)
        self._log("reduce_scatter", _nbytes([c for chunks in inputs for c in chunks]))
        return _done(outputs)

    def reduce_scatter_single(self, output, input, opts=None):
        return self.reduce_scatter([output], [list(torch.chunk(input, self._size))], opts)

    def _reduce_scatter_base(self, output, input, opts=None):
        return self.reduce_scatter_single(output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self.reduce_scatter_single(o, i, opts)
        return _done(outputs)

    # -- gathers -----------------------------------------------------------------------------------
    def allgather(self, outputs, inputs, opts=None):
        for outs, t in zip(outputs, inputs):
            for o in outs:
                o.copy_(t)
        self._log("all_gather", _nbytes([o for outs in outputs for o in outs]))
        return _done(outputs)

    def all_gather_single(self, output, input, opts=None):
        output.copy_(input.reshape(1, -1).expand(self._size, -1).reshape(output.shape))
        self._log("all_gather", _nbytes([output]))
        return _done([output])

    def _allgather_base(self, output, input, opts=None):
        return self.all_gather_single(output, input, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self.all_gather_single(o, i, opts)
        return _done(outputs)

    def allgather_coalesced(self, outputs, inputs, opts=None):
        return self.allgather(outputs, inputs, opts)

    def gather(self, outputs, inputs, opts=None):
        for outs in outputs:
            for o, t in zip(outs, inputs * len(outs)):
                o.copy_(t)
        self._log("gather", _nbytes(inputs) * self._size)
        return _done(outputs)

    # -- one to all, all to all ----------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        self._log("broadcast", _nbytes(tensors))
        return _done(tensors)

    def scatter(self, outputs, inputs, opts=None):
        root = opts.rootRank if opts is not None else 0
        for i, out in enumerate(outputs):
            if root == self._rank and inputs:
                out.copy_(inputs[i][self._rank])
            else:
                _fill(out)
        self._log("scatter", _nbytes(outputs))
        return _done(outputs)

    def alltoall(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            o.copy_(i)
        self._log("all_to_all", _nbytes(outputs))
        return _done(outputs)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        if output.shape == input.shape:
            output.copy_(input)
        else:
            _fill(output)
        self._log("all_to_all", _nbytes([output]))
        return _done([output])

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def barrier(self, opts=None):
        self._log("barrier", 0)
        return _done([])

    # -- point to point ------------------------------------------------------------------------------
    def send(self, tensors, dst, tag=0):
        self._log(_p2p_kind("send", tensors), _nbytes(tensors))
        return _done(tensors)

    def recv(self, tensors, src, tag=0):
        for t in tensors:
            _fill(t)
        self._log(_p2p_kind("recv", tensors), _nbytes(tensors))
        return _done(tensors)

    def recv_anysource(self, tensors, tag=0):
        return self.recv(tensors, -1, tag)


def _create(options, backend_options) -> RehearsalGroup:
    """The plug-in's creator (``extended_api=True``: the group's global ranks come with it)."""
    ranks = tuple(options.global_ranks_in_group) or tuple(range(options.group_size))
    return RehearsalGroup(options.group_rank, options.group_size, options.group_id, ranks, _LEDGER)


def register() -> None:
    """Make ``init_process_group(backend="rehearse", ...)`` create rehearsal groups (once)."""
    if BACKEND.upper() not in dist.Backend._plugins:  # private: torch keeps no public registry query
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def peak_tracker(modules, optimizer, *tensors):
    """A ``MemTracker`` (enter it around the steps) following ``modules``, ``optimizer`` and other
    ``tensors`` held through the steps (made before it, which it would not see otherwise). The
    tracker refuses a root module called twice in one iteration, which a pipeline stage is (once
    per microbatch): each forward of a stage module starts its module statistics afresh (only the
    device-wide peak is read, ``peak_split``)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*modules, optimizer, *tensors)
    roots = {id(m) for m in modules}
    pre_forward = tracker._pre_fw_hook  # registered with the module tracker as the tracker is entered

    def fresh_pre_forward(module, inputs):
        if id(module) in roots and not tracker._mod_tracker.is_bw:
            tracker.memory_tracking.pop(module, None)
        pre_forward(module, inputs)

    tracker._pre_fw_hook = fresh_pre_forward  # type: ignore[method-assign]
    if all(hasattr(tracker, a) for a in ("_update_peak_stats", "_curr_mem_snap", "_peak_mem", "_peak_mem_snap")):
        tracker._update_peak_stats = partial(_device_peak, tracker)  # type: ignore[method-assign]
    _no_multi_grad_hook_on_leaves(tracker._mod_tracker)
    _grad_hooks_removed_on_exit(tracker._mod_tracker)
    return tracker


def _device_peak(tracker, peak_state) -> None:
    """The tracker's peak update after every op, less its per-module peaks (``peak_split`` reads
    the device-wide one only): torch's walks every module's statistics on every op, about a
    quarter of a tracked step's CPU time on a 0.5B Llama rank (issue #35); the device-wide peak is
    updated as torch updates it (a torch without these attributes keeps its own update)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    for dev, snap in tracker._curr_mem_snap.items():
        if tracker._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
            tracker._peak_mem[dev] = snap[_TOTAL_KEY]
            tracker._peak_mem_snap[dev] = dict(snap)


def _no_multi_grad_hook_on_leaves(mod_tracker) -> None:
    """The module tracker's forward pre-hook registers a multi-grad hook on a module's inputs that
    need a gradient; where one is a leaf (a pipeline stage's received input), the hook raises
    ("A leaf node was passed to _will_engine_execute_node ...") as the zero-bubble schedules' I
    action differentiates the stage with ``autograd.grad`` for that input. It sees each such leaf
    detached (the same storage: the tracker counts the same bytes); its module leaves the tracker's
    set of modules at the end of the backward, as one with no such input does."""
    from torch.utils._pytree import tree_map_only

    pre_forward = mod_tracker._fw_pre_hook  # registered as the tracker is entered

    def pre_forward_without_leaves(module, inputs):
        detached = tree_map_only(torch.Tensor, lambda t: t.detach() if t.is_leaf and t.requires_grad else t, inputs)
        pre_forward(module, detached)  # nothing returned: the module runs on its own inputs

    mod_tracker._fw_pre_hook = pre_forward_without_leaves


def _grad_hooks_removed_on_exit(mod_tracker) -> None:
    """The module tracker registers a multi-grad hook on each module's inputs and outputs at every
    forward (``register_multi_grad_hook``, which its module imports) and never removes them. A hook
    of torch's "all" mode holds its tensors' autograd nodes, and each node holds the hook: a cycle
    through C++ that Python's collector cannot see. It kept each step's graph alive, and through its
    gradient accumulators the parameters with their gradients: a rank rehearsed before another in
    one process stayed in the later rank's ``device_peak_bytes`` (found on the GPU, issue #35), and a
    test process's FSDP modules outlived its run. Here each hook's handle is kept as the tracker's
    forward hooks register it, and all are removed as the tracker exits (after the step's backward:
    nothing is left to call them)."""
    import torch.distributed._tools.mod_tracker as mod_tracker_module

    register = getattr(mod_tracker_module, "register_multi_grad_hook", None)
    if register is None:  # a torch whose module tracker registers its hooks otherwise: left as it is
        return
    handles: list = []

    def register_keeping(*args, **kwargs):
        handle = register(*args, **kwargs)
        handles.append(handle)
        return handle

    def keeping(hook):
        def forward_hook(*args):
            mod_tracker_module.register_multi_grad_hook = register_keeping
            try:
                return hook(*args)
            finally:
                mod_tracker_module.register_multi_grad_hook = register
        return forward_hook

    # (instance attributes: the tracker registers ``self._fw_pre_hook`` and the rest as it is entered)
    mod_tracker._fw_pre_hook = keeping(mod_tracker._fw_pre_hook)
    mod_tracker._fw_post_hook = keeping(mod_tracker._fw_post_hook)
    leave = mod_tracker.__exit__

    def exit_and_remove(*args):
        leave(*args)
        for handle in handles:
            handle.remove()
        handles.clear()

    mod_tracker.__exit__ = exit_and_remove  # called as ``self._mod_tracker.__exit__`` by the MemTracker


def peak_split(tracker, device: torch.device) -> dict[str, int]:
    """The tracker's peak on ``device`` (this rank's): parameters, gradients, optimizer state,
    activations and the rest (buffers, temporaries, other), and their total. The tracker keeps a
    peak per device it saw: a GPU rank's has the CPU's too (AdamW's ``step`` counts live on the CPU
    unless fused or capturable), in no promised order."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, _MemRefType

    snapshot = tracker.get_tracker_snapshot("peak")
    by_kind = snapshot.get(torch.device(device), {})
    params, grads, opt = (by_kind.get(k, 0) for k in (_MemRefType.PARAM, _MemRefType.GRAD, _MemRefType.OPT))
    total = by_kind.get(_TOTAL_KEY, 0)
    return {"params": params, "grads": grads, "optimizer_state": opt,
            "activations_and_rest": total - params - grads - opt, "total": total}
