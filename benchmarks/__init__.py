"""The stepops benchmark harness: ``python -m benchmarks`` (see ``benchmarks/__main__.py``)."""
