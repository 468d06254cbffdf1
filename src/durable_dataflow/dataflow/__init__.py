"""Dataflow: the part that defines, runs and schedules dataflows, in four wings and two rooms.

Wings, each importing only the ones before it (tests/unit/test_code_shape.py holds the order):
``definitions`` (what a dataflow is) <- ``execution`` (computing its result: sources, engines,
limits, result bytes) <- ``protocol`` (the run's recorded life: submit, attempts, publication,
reconcile, sweep, cancel, reads) <- ``schedules`` (runs submitted by time: schedules, backfills).
Below every wing: ``schema`` (the part's tables; each has one owning module). Above every wing:
``worker`` (the loop that claims, sweeps and ticks). Imports core and datasources only (DESIGN §2).
"""
