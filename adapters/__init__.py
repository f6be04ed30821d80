"""Task adapters shipped with Echo (found through the ``echo.adapters`` entry points)."""
