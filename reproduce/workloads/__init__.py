"""Workloads: the load part of a run, one interface whatever its kind (``base.Workload``).

``pulse`` (the study's), ``steps`` (a stepped load) and the request-trace replay
(``reproduce.workloads.trace``) each live in a module of their own and are registered by name in
``registry``: a new kind is its module and one line there. Nothing that plans, runs, judges or
draws a run asks which kind it has.
"""
