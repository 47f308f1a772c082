"""Typer command-line app of omnidraft."""
