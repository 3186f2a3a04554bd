"""Files written whole or not at all, and their digests: the one home of both (``storage/files.py``).

The bottom of the import flow beside ``config/``: it imports nothing of ours, so ``data/`` and ``parallel/``
(siblings that must not import each other), and every package above them, can share it.
"""
