"""The test suite: app/ (in-process), system/ (real processes), support/ (the harness, bench/'s too)."""
