"""jitckpt sidecar: restore from S3, watch staging/, upload newest-first, export metrics."""

__version__ = "0.1.0"
