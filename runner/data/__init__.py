"""Datasets (``datasets``: ``data=synthetic|text|hf|tokens``, each a pure function of seed, split and
step), the files a form reads (``files``, ``records``, ``token_files``), tokenization and its cache
(``tokens``, ``token_cache``, ``cache_files``). Schema: ``config`` (``data=...``). Nothing is
imported here."""
