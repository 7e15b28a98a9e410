"""Helpers that tests and benchmarks share (the server never imports them): free ports, the
one way to start a cluster or a standalone store, calls to a running cluster's API, and hosts in
network namespaces. They start processes from this checkout, so they are for a source tree."""
