"""Tuning: the choices measured on the user's machine at run time (kernels, dtype)."""
