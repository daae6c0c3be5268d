"""One-off studies whose results are in bench/results/, each run as `python -m bench.studies.<name>`."""
