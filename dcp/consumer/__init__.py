"""The Python consumer SDK."""
