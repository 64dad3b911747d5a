"""Which target layers the DSpark drafter reads (its training and the runtimes agree on them)."""

TAP_LAYERS = (3, 15, 27)
