"""Checkpoints: saving and loading through DCP (``checkpointer.Checkpointer``), finding them and
their manifests (``files``), what one records of its run and a resume's checks (``resume_check``),
a checkpoint's whole model in one process (``model``: export, generate). Nothing is imported here."""
