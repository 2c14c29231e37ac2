"""Triton kernels behind the public ops, one file per op plus shared helpers.

Imported lazily, only when a triton backend runs: importing `kvfuse.kernels` never imports triton. The
interpreter switch (``TRITON_INTERPRET=1``) is read by triton when these modules are first imported, so it must
be set before the first triton call.
"""
