"""A module whose import fails (tests: the probe-by-import-path error names the spec and the cause)."""
raise RuntimeError("this module is broken on import")
