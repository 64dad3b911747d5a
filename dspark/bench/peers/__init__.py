"""Other implementations the benchmarks measure dspark against, each behind one module."""
