"""`python -m jitckpt_sidecar` = `jitckpt-sidecar`."""

import sys

from jitckpt_sidecar.cli import main

sys.exit(main())
