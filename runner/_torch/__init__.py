"""Every use of torch's private internals, fenced so that a torch upgrade touches this package
only: ``pp`` (pipelining's ``_Action``, the CSV runtime, the validator and simulator), ``dcp``
(distributed checkpoints, loaded the safe way), ``dist`` (what keeps process groups alive),
``rehearsal`` (the rehearsal's process group, the memory tracker), ``datasheet`` (the device
datasheet table ``plan.target`` reads) and ``dispatch`` (fake tensors, the dispatch mode and the
private aten ops that counting FLOPs names). ``tests/test_architecture.py`` refuses such a use
anywhere else in ``runner/``. Nothing is imported here."""
