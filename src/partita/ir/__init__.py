"""The program representation the stages hand each other, beside torch.fx's own.

``collectives`` and ``buckets``: partita's mesh ops of the per-device IR (``torch.library``
custom ops); ``node_meta``: the typed fields stages record on fx nodes; ``op_lookup``: ops by
exact name (what a cache file may call). Imports no stage.
"""
