"""Every use of torch's private internals, fenced so that a torch upgrade touches this package
only: ``pp`` (pipelining's ``_Action``, the CSV runtime, the validator and simulator), ``dcp``
(distributed checkpoints, loaded the safe way), ``dist`` (what keeps process groups alive). Nothing
is imported here."""
