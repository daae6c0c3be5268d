"""One harness for the in-process tests, the system tests and the benchmark: processes, answers, Error checks."""
