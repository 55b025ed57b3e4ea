"""Benchmarks: each module's ``run()`` measures against a baseline taken in the same run
and returns a markdown section; ``python -m benchmarks [names]`` rewrites those sections
of docs/BENCHMARKS.md in place."""
