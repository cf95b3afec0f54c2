"""The kvbm command line."""
