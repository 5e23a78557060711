"""Installed at interpreter start in processes running under jitckpt-entrypoint."""


def install() -> None:
    """Placeholder: the SIGTERM flag, post-import Trainer patch and resume arrive with the hook."""
