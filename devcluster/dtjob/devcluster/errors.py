"""The one exception the devcluster raises for anything a user can fix."""


class DevclusterError(Exception):
    """A problem the user can fix; the CLI prints it as one line `devcluster: <message>`."""
