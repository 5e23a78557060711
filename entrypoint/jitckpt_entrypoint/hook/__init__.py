"""The trainer-side hook; this module will also carry the public API for plain PyTorch loops.

Imported inside every training process (through sitecustomize), so it imports nothing heavy.
"""
