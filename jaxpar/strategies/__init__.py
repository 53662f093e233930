"""The strategies: one module each, one contract (`base.Strategy`), one registry behind `--strategy`."""
