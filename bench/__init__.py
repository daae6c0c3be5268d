"""`make bench`: the service against the floors under wrk (python -m bench.run)."""
