"""Reconciliation of two captures: pure checks, and the PySpark job that applies them.

``checks`` and ``streams`` are the pure functions; ``latency`` the
distribution; ``source`` the Spark data source for capture segments
(``spark.read.format("tapupr-capture")``); ``job`` runs the reconciliation;
``report`` renders its result; ``command`` is ``tap-upr-gateway verify``.
Only ``source``, ``job`` and ``command`` import pyspark.
"""
