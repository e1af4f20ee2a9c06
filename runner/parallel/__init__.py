"""The parallel layout: ``dims.ParallelDims`` (the one owner of the degrees and the rank order),
``mesh.Mesh`` (the device mesh and its groups), and what each dimension does to a stage module,
applied by ``parallelize.parallelize_stage``: ``tp`` (tensor parallelism), ``dp`` (the data-parallel
mode registry), ``tied`` (weights tied across stages). Schema: ``config.ParallelConfig``
(``parallel.*``). Nothing is imported here."""
