"""jitckpt trainer side: the PID-1 entrypoint and the sitecustomize hook.

Standard library only at import time: this package also runs from a bundle copied into users'
own images (swap-in mode), under whatever python3 those images ship.
"""

__version__ = "0.1.0"
