"""Executors: the code that holds per-device data and runs per-device programs.

``stacked`` has the mesh ops on stacked tensors (the simulated mesh); ``local`` runs programs.
"""
