"""The one exception type of the trainer-side package, caught at the CLI edge."""


class JitckptError(Exception):
    """A problem the user can fix; its message is one line that names the fix."""
