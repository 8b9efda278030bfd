"""platform package."""
