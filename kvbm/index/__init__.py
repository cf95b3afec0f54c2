"""The block index: which tier holds which block (no I/O): registry, key codes, footprints."""
