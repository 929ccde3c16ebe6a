"""Schedulers: one module per backend behind one small interface (base.py)."""
