"""`python -m jitckpt_entrypoint [OPTIONS] -- COMMAND [ARG...]`."""

import sys

from jitckpt_entrypoint.cli import main

sys.exit(main())
