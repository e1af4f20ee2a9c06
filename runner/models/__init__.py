"""Models: the built-in factories (``builtin``), Hugging Face families (``hf``, ``hf_weights``,
``hf_dirs``), a model's pipeline units (``units.ModelSpec``), the meta model cut into stages and
materialised (``split``), and weights read as tensor-parallel shards (``shards``).
Schema: ``config.ModelConfig`` and one per factory (``model=...``). Nothing is imported here."""
