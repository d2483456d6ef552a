"""Development fixtures: tiny local models for tests, benchmarks and the demo.

Not part of the runtime: no module of ``worker`` outside ``worker.dev`` imports it
(``tests/test_structure.py``).
"""
