"""Locust load tests of the ensemble (run with ``locust -f warmup_tools/sim/load/locustfile.py``)."""
