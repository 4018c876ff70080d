"""The version string, read by the build."""

__version__ = "0.3.0.dev0"
