"""The torch-free heart: block pool, per-request block tables, and the scheduler.

The real engine, the simulator and the property tests all run this same code.
"""
