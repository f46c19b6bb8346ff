"""toolreg benchmarks: `make bench` (python -m bench)."""
