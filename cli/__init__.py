"""The `slipstream` command: entry points that wire the library together (they import every layer)."""
